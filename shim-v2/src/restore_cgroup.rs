//! A restored container's processes in its own cgroup (#28, #27.7).
//!
//! On cgroup v2 runc (1.1 through 1.3: `criuApplyCgroups` returns before it sets any
//! `CgRoot`) moves CRIU into the new container's cgroup but tells CRIU no cgroup root, so
//! CRIU (soft mode) puts the restored tasks back into the cgroup path recorded in the image:
//! the checkpointed container's, not the one of the new config.json (CRI gives a restored
//! container a new id and a cgroup under its new pod; two ctr restores of one checkpoint
//! would share one). runc offers no flag for CRIU's cgroup root (`--manage-cgroups-mode
//! ignore` is 1.2+ only), so after `runc restore` and before the GPU is given back, the shim
//! moves the restored tree into the cgroup runc made for this container. On cgroup v1 runc
//! passes every controller's root to CRIU, and nothing needs moving.
//!
//! Before either, a restore's spec is the checkpoint's (ctr, the Task API), whose
//! `linux.cgroupsPath` names the checkpointed container's cgroup: two restores of one
//! checkpoint would get one cgroup on both versions. `rename_spec_cgroup` gives the restored
//! container its own at Create.
//!
//! A restore that fails mid-way (runc killed, a deadline) leaves what CRIU had forked:
//! `kill_restored_tree` kills it by the root CRIU's log names, wherever CRIU put it, and
//! `kill_spec_cgroup` whatever else is in the restore's own cgroup.

use std::path::{Path, PathBuf};

const CGROUP2_ROOT: &str = "/sys/fs/cgroup";

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "container {id}: runc's state {path} names no cgroup v2 path ({msg}); the restored \
         processes stay in the checkpoint's cgroup — check that runc (not another runtime) \
         made the container"
    )]
    NoCgroup {
        id: String,
        path: PathBuf,
        msg: String,
    },
    #[error(
        "container {id}: moving restored pid {pid} into its cgroup {cgroup}: {source}; check \
         that the cgroup exists and the shim may write its cgroup.procs"
    )]
    Move {
        id: String,
        pid: i32,
        cgroup: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Points `linux.cgroupsPath` of the bundle's spec at the restored container `id` where its
/// last component (after `/`, or `:` for systemd's `slice:prefix:name`) is the checkpointed
/// container's id; returns the new path when it changed it.
pub fn rename_spec_cgroup(
    bundle: &Path,
    checkpointed: &str,
    id: &str,
) -> std::io::Result<Option<String>> {
    if checkpointed.is_empty() || checkpointed == id {
        return Ok(None);
    }
    let path = bundle.join("config.json");
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    let Some(cgroup) = spec["linux"]["cgroupsPath"].as_str() else {
        return Ok(None);
    };
    let cut = cgroup.rfind(['/', ':']).map_or(0, |i| i + 1);
    if cgroup[cut..] != *checkpointed {
        return Ok(None);
    }
    let renamed = format!("{}{id}", &cgroup[..cut]);
    spec["linux"]["cgroupsPath"] = renamed.clone().into();
    std::fs::write(&path, serde_json::to_vec(&spec)?)?;
    Ok(Some(renamed))
}

/// SIGKILLs every process in the cgroup the bundle's spec names (`linux.cgroupsPath`, in
/// any hierarchy) and returns their pids: what a `runc restore` killed mid-way leaves
/// running — tasks CRIU had forked and moved out of runc's process group, orphaned to the
/// shim before runc registered the container, so `runc delete` does not know them. The
/// spec's path is this restore's own (see `rename_spec_cgroup`). On cgroup v2, CRIU puts
/// restored tasks into the checkpoint's cgroup instead (see the module doc), which is
/// never touched here: [`kill_restored_tree`] finds those.
pub fn kill_spec_cgroup(bundle: &Path) -> Vec<i32> {
    let Some(want) = spec_cgroup_suffix(bundle) else {
        return Vec::new();
    };
    let in_cgroup = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|text| {
            text.lines()
                .filter_map(|l| l.splitn(3, ':').nth(2))
                .any(|path| path.ends_with(&want))
        })
    };
    let killed: Vec<i32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|pid| in_cgroup(*pid))
        .collect();
    for pid in &killed {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    killed
}

/// Now, in the clock ticks of `/proc/<pid>/stat`'s start time (since boot): taken before a
/// restore, to tell what it forked from anything older.
pub fn boot_ticks() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes the timespec it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return u64::MAX;
    }
    // SAFETY: sysconf(3) has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    ts.tv_sec as u64 * hz + ts.tv_nsec as u64 * hz / 1_000_000_000
}

/// SIGKILLs the tree a failed restore forked, wherever CRIU put it (#27): on cgroup v2 that
/// is the cgroup recorded in the image, which may be the running original's, where
/// [`kill_spec_cgroup`] does not look and which must not be emptied. The root is the one
/// CRIU logged forking (`criu_log::restored_root`), killed with its descendants only while
/// that pid is still CRIU's: a child of this shim (the subreaper it was orphaned to when
/// CRIU died), started at or after `since` ([`boot_ticks`] before the restore: never a
/// process of the original, which is older), with the logged pid in its own PID namespace.
/// Returns the pids killed.
pub fn kill_restored_tree(log: &Path, since: u64) -> Vec<i32> {
    let Some((real, virt)) = crate::criu_log::restored_root(log) else {
        return Vec::new();
    };
    if !is_restored_root(real, virt, std::process::id() as i32, since) {
        return Vec::new();
    }
    crate::reaper::kill_tree(real)
}

/// Whether `pid` is a child of `parent` started at or after `since`, whose pid in its own
/// (innermost) PID namespace is `virt`.
fn is_restored_root(pid: i32, virt: i32, parent: i32, since: u64) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let ppid = field("PPid:").and_then(|v| v.parse::<i32>().ok());
    let innermost = field("NSpid:")
        .and_then(|v| v.split_whitespace().last())
        .and_then(|v| v.parse::<i32>().ok());
    let started = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // Fields follow the last ')'; the start time is the 22nd field of the line.
            let rest = &stat[stat.rfind(')')? + 1..];
            rest.split_whitespace().nth(19)?.parse::<u64>().ok()
        });
    ppid == Some(parent) && innermost == Some(virt) && started.is_some_and(|t| t >= since)
}

/// How the spec's cgroup shows in `/proc/<pid>/cgroup`: the path itself (cgroupfs), or
/// `/<prefix>-<name>.scope` for systemd's `slice:prefix:name`.
fn spec_cgroup_suffix(bundle: &Path) -> Option<String> {
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).ok()?).ok()?;
    let path = spec["linux"]["cgroupsPath"].as_str()?;
    let suffix = match path.split(':').collect::<Vec<_>>()[..] {
        [_, prefix, name] => format!("/{prefix}-{name}.scope"),
        _ => format!("/{}", path.trim_matches('/')),
    };
    (suffix.len() > 1).then_some(suffix)
}

/// Moves `init` and its descendants into the container's own cgroup (runc's state of `id`
/// under `runc_root`) when they are elsewhere; returns how many moved.
pub fn adopt(runc_root: &Path, id: &str, init: u32) -> Result<usize, CgroupError> {
    if !Path::new(CGROUP2_ROOT).join("cgroup.controllers").exists() {
        return Ok(0);
    }
    let target = own_cgroup(runc_root, id)?;
    let mut moved = 0;
    for pid in crate::reaper::tree_of(init as i32) {
        if current_cgroup(pid).is_some_and(|c| c == target) {
            continue;
        }
        // Writing a pid moves its whole thread group.
        std::fs::write(target.join("cgroup.procs"), pid.to_string()).map_err(|source| {
            CgroupError::Move {
                id: id.to_string(),
                pid,
                cgroup: target.clone(),
                source,
            }
        })?;
        moved += 1;
    }
    if moved > 0 {
        tracing::info!(%id, moved, cgroup = %target.display(),
            "restored processes moved from the checkpoint's cgroup into the container's");
    }
    Ok(moved)
}

/// runc's `cgroup_paths[""]` (cgroup v2's one path) from `<root>/<id>/state.json`.
fn own_cgroup(runc_root: &Path, id: &str) -> Result<PathBuf, CgroupError> {
    let path = runc_root.join(id).join("state.json");
    let err = |msg: String| CgroupError::NoCgroup {
        id: id.to_string(),
        path: path.clone(),
        msg,
    };
    let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
    let state: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
    state["cgroup_paths"][""]
        .as_str()
        .map(PathBuf::from)
        .ok_or_else(|| err("no cgroup_paths entry".into()))
}

/// The cgroup v2 directory `pid` is in (`0::` of /proc/<pid>/cgroup), as seen from the host.
fn current_cgroup(pid: i32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(Path::new(CGROUP2_ROOT).join(rel.trim_start_matches('/')))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_with(dir: &Path, cgroup: &str) {
        let spec = serde_json::json!({"linux": {"cgroupsPath": cgroup}});
        std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
    }

    fn cgroup_of(dir: &Path) -> String {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        v["linux"]["cgroupsPath"].as_str().unwrap().to_owned()
    }

    #[test]
    fn the_spec_cgroup_shows_as_its_path_or_its_systemd_scope() {
        let d = tempfile::tempdir().unwrap();
        spec_with(d.path(), "/k8s.io/abc");
        assert_eq!(spec_cgroup_suffix(d.path()).as_deref(), Some("/k8s.io/abc"));
        spec_with(d.path(), "system.slice:cri-containerd:abc");
        assert_eq!(
            spec_cgroup_suffix(d.path()).as_deref(),
            Some("/cri-containerd-abc.scope")
        );
        spec_with(d.path(), "/");
        assert_eq!(spec_cgroup_suffix(d.path()), None);
        // No process is in a cgroup that does not exist.
        spec_with(d.path(), "/gpucr-test-no-such-cgroup/x");
        assert!(kill_spec_cgroup(d.path()).is_empty());
    }

    #[test]
    fn only_the_restores_own_root_is_killed() {
        let since = boot_ticks();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let me = std::process::id() as i32;
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("restore.log");
        // Not the logged pid in its namespace, not this process's child, or older than the
        // restore: left alone.
        assert!(!is_restored_root(pid, pid + 1, me, since));
        assert!(!is_restored_root(pid, pid, me + 1, since));
        assert!(!is_restored_root(pid, pid, me, boot_ticks() + 1000));
        assert!(!is_restored_root(me, me, me, 0));
        std::fs::write(&log, format!("(00.01) PID: real {me} virt {me}\n")).unwrap();
        assert!(kill_restored_tree(&log, 0).is_empty());
        assert!(child.try_wait().unwrap().is_none());
        // The restore's own: killed.
        std::fs::write(&log, format!("(00.01) PID: real {pid} virt {pid}\n")).unwrap();
        assert_eq!(kill_restored_tree(&log, since), vec![pid]);
        assert!(!child.wait().unwrap().success());
    }

    #[test]
    fn the_checkpointed_containers_cgroup_is_renamed_for_the_restore() {
        let d = tempfile::tempdir().unwrap();
        spec_with(d.path(), "/k8s.io/old");
        assert_eq!(
            rename_spec_cgroup(d.path(), "old", "new")
                .unwrap()
                .as_deref(),
            Some("/k8s.io/new")
        );
        assert_eq!(cgroup_of(d.path()), "/k8s.io/new");
        spec_with(d.path(), "system.slice:cri-containerd:old");
        rename_spec_cgroup(d.path(), "old", "new").unwrap();
        assert_eq!(cgroup_of(d.path()), "system.slice:cri-containerd:new");
        // A cgroup of the client's choosing (CRI's new pod) stays.
        spec_with(d.path(), "/kubepods/pod1/other");
        assert_eq!(rename_spec_cgroup(d.path(), "old", "new").unwrap(), None);
        assert_eq!(cgroup_of(d.path()), "/kubepods/pod1/other");
        assert_eq!(rename_spec_cgroup(d.path(), "new", "new").unwrap(), None);
    }
}
