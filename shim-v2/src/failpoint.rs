//! Failpoints: named steps of a checkpoint and a restore where the fault-injection suite
//! (`tests/tests/faults.rs`) makes the shim fail or hold, to prove that each step's undo
//! leaves the task as its client had it.
//!
//! Off unless `GPUCR_FAILPOINTS` names a directory (containerd passes its environment to its
//! shims). A file `<dir>/<point>` arms `<point>` for one hit: the shim removes it when it gets
//! there, then
//! - the file is empty (or says `error`): the step fails with [`Error::Failpoint`] and what
//!   the operation did so far is undone, as for any real failure at that step;
//! - it says `pause`: the shim writes `<dir>/<point>.held` and waits while that file exists,
//!   so that the test can kill the shim, CRIU or runc, or restart containerd, right there;
//!   then the step goes on.
//!
//! The points and the outcome each must have are listed in docs/ARCHITECTURE.md.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, Result};

pub const ENV: &str = "GPUCR_FAILPOINTS";

/// Before anything of a checkpoint: no hook copy-out, no freeze, no lock yet.
pub const CHECKPOINT_BEFORE_FREEZE: &str = "checkpoint.before-freeze";
/// After the hook's processes moved their device memory out (before the driver's lock).
pub const CHECKPOINT_AFTER_COPY_OUT: &str = "checkpoint.after-copy-out";
/// With the GPU locked and the task frozen for CRIU, before `runc checkpoint`.
pub const CHECKPOINT_BEFORE_DUMP: &str = "checkpoint.before-dump";
/// After the dump and the GPU's give-back, before the manifest seals the image.
pub const CHECKPOINT_BEFORE_MANIFEST: &str = "checkpoint.before-manifest";
/// A restore's image checked and its helpers started, before `runc restore`.
pub const RESTORE_BEFORE_CRIU: &str = "restore.before-criu";
/// After CRIU restored the process tree, before its cgroup, devices and GPU state.
pub const RESTORE_AFTER_CRIU: &str = "restore.after-criu";
/// After the driver's GPU restore, before the hook's processes get their memory back.
pub const RESTORE_BEFORE_HOOK_COPY_IN: &str = "restore.before-hook-copy-in";

pub const ALL: [&str; 7] = [
    CHECKPOINT_BEFORE_FREEZE,
    CHECKPOINT_AFTER_COPY_OUT,
    CHECKPOINT_BEFORE_DUMP,
    CHECKPOINT_BEFORE_MANIFEST,
    RESTORE_BEFORE_CRIU,
    RESTORE_AFTER_CRIU,
    RESTORE_BEFORE_HOOK_COPY_IN,
];

fn dir() -> Option<PathBuf> {
    std::env::var_os(ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// What an armed point asks for.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Fail,
    Pause,
}

/// Disarms `point` in `dir` and says what it asked for (`None`: not armed).
fn take(dir: &Path, point: &str) -> Option<Action> {
    let file = dir.join(point);
    let text = std::fs::read_to_string(&file).ok()?;
    // Removed before it acts: a point fires once, even if the shim dies at it.
    std::fs::remove_file(&file).ok()?;
    Some(match text.trim() {
        "pause" => Action::Pause,
        _ => Action::Fail,
    })
}

/// Passes `point`: fails, holds or does nothing, as its file says (see the module doc).
pub async fn hit(id: &str, point: &'static str) -> Result<()> {
    let Some(dir) = dir() else { return Ok(()) };
    match take(&dir, point) {
        None => Ok(()),
        Some(Action::Fail) => {
            tracing::warn!(id, point, "failpoint: failing here");
            Err(Error::Failpoint { point })
        }
        Some(Action::Pause) => {
            let held = dir.join(format!("{point}.held"));
            std::fs::write(&held, std::process::id().to_string())
                .map_err(|e| Error::io(format!("writing {}", held.display()), e))?;
            tracing::warn!(
                id,
                point,
                "failpoint: holding until {} is removed",
                held.display()
            );
            while held.exists() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tracing::warn!(id, point, "failpoint: released");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_fires_once_and_says_what_it_asks_for() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(take(d.path(), RESTORE_BEFORE_CRIU), None);
        std::fs::write(d.path().join(RESTORE_BEFORE_CRIU), "").unwrap();
        std::fs::write(d.path().join(RESTORE_AFTER_CRIU), "pause\n").unwrap();
        assert_eq!(take(d.path(), RESTORE_BEFORE_CRIU), Some(Action::Fail));
        assert_eq!(take(d.path(), RESTORE_BEFORE_CRIU), None);
        assert_eq!(take(d.path(), RESTORE_AFTER_CRIU), Some(Action::Pause));
        assert!(!d.path().join(RESTORE_AFTER_CRIU).exists());
    }

    #[test]
    fn the_error_names_the_point() {
        let e = Error::Failpoint {
            point: CHECKPOINT_BEFORE_DUMP,
        };
        assert!(e.to_string().contains("checkpoint.before-dump"), "{e}");
    }
}
