//! Looking at and cleaning up processes and mounts through /proc.

use std::fs;
use std::path::Path;

/// One process's pid and argv.
#[derive(Debug, Clone)]
pub struct ProcessInfo {
    pub pid: i32,
    pub argv: Vec<String>,
}

/// Every process whose argv can be read.
pub fn processes() -> Vec<ProcessInfo> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let argv = raw
                .split(|b| *b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect();
            Some(ProcessInfo { pid, argv })
        })
        .collect()
}

impl ProcessInfo {
    /// The value after `flag` in argv (`-id foo` gives `foo`).
    pub fn flag(&self, flag: &str) -> Option<&str> {
        let at = self.argv.iter().position(|a| a == flag)?;
        self.argv.get(at + 1).map(String::as_str)
    }

    /// True when argv[0] names a containerd shim.
    pub fn is_shim(&self) -> bool {
        self.argv.first().is_some_and(|a0| {
            Path::new(a0)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("containerd-shim"))
        })
    }
}

/// Shim processes started by the containerd listening on `address`.
pub fn shims_of(address: &str) -> Vec<ProcessInfo> {
    processes()
        .into_iter()
        .filter(|p| p.is_shim() && p.flag("-address") == Some(address))
        .collect()
}

/// The pid of the shim serving container `id` for the containerd on `address`.
pub fn shim_pid(address: &str, id: &str) -> Option<i32> {
    shims_of(address)
        .into_iter()
        .find(|p| p.flag("-id") == Some(id))
        .map(|p| p.pid)
}

/// True while `pid` exists and is not a zombie.
pub fn is_alive(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Sends signal `sig` to `pid`.
pub fn signal(pid: i32, sig: i32) -> std::io::Result<()> {
    // SAFETY: kill(2) has no memory-safety preconditions.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Sends SIGKILL to `pid`.
pub fn sigkill(pid: i32) -> std::io::Result<()> {
    signal(pid, libc::SIGKILL)
}

/// Waits until `pid` is gone (or a zombie): `what` names the wait in the timeout's error.
pub fn wait_gone(what: &str, pid: i32, timeout: std::time::Duration) -> crate::Result<()> {
    crate::poll_until(what, timeout, || {
        Ok(if is_alive(pid) { Err(pid) } else { Ok(()) })
    })
}

/// Kills every shim of the containerd on `address` (used after the daemon is gone).
pub fn kill_shims_of(address: &str) {
    for shim in shims_of(address) {
        let _ = sigkill(shim.pid);
    }
}

/// Pids whose cgroup path lies under `/<namespace>/` (ctr's default cgroupsPath).
pub fn cgroup_members(namespace: &str) -> Vec<i32> {
    let prefix = format!(":/{namespace}/");
    processes()
        .into_iter()
        .filter(|p| {
            fs::read_to_string(format!("/proc/{}/cgroup", p.pid))
                .is_ok_and(|text| text.lines().any(|l| l.contains(&prefix)))
        })
        .map(|p| p.pid)
        .collect()
}

/// Kills container processes left in the namespace's cgroups.
pub fn kill_cgroup_members(namespace: &str) {
    for pid in cgroup_members(namespace) {
        let _ = sigkill(pid);
    }
}

/// Mount points of this mount namespace at or under `dir`, deepest last.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().into_owned();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split(' ').nth(4).map(unescape_mountinfo))
        .filter(|mount_point| {
            mount_point == &prefix || mount_point.starts_with(&format!("{prefix}/"))
        })
        .collect()
}

fn unescape_mountinfo(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Lazily unmounts everything at or under `dir`, deepest first.
pub fn unmount_under(dir: &Path) {
    for mount_point in mounts_under(dir).into_iter().rev() {
        let Ok(c_path) = std::ffi::CString::new(mount_point) else {
            continue;
        };
        // SAFETY: umount2(2) with a valid NUL-terminated path.
        unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
    }
}
