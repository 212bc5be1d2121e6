//! The host pids of a container, from its cgroup (v1 or v2) or given directly.

use std::path::{Path, PathBuf};

use crate::error::DiscoveryError;

/// Where the cgroup filesystems are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// How to find a container's processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessSource {
    /// Exactly these host pids.
    Pids(Vec<u32>),
    /// Every process in this cgroup directory and the cgroups below it.
    Cgroup(PathBuf),
    /// Every process in the cgroup of this pid (e.g. the container's init).
    CgroupOfPid(u32),
}

impl ProcessSource {
    /// The host pids, sorted and without duplicates.
    pub fn pids(&self) -> Result<Vec<u32>, DiscoveryError> {
        match self {
            ProcessSource::Pids(p) => {
                let mut p = p.clone();
                p.sort_unstable();
                p.dedup();
                Ok(p)
            }
            ProcessSource::Cgroup(dir) => cgroup_pids(dir),
            ProcessSource::CgroupOfPid(pid) => {
                cgroup_pids(&cgroup_dir_of_pid(*pid, Path::new(CGROUP_ROOT))?)
            }
        }
    }
}

/// Reads `cgroup.procs` in `dir` and every cgroup below it (containers may nest).
pub fn cgroup_pids(dir: &Path) -> Result<Vec<u32>, DiscoveryError> {
    let mut pids = Vec::new();
    collect(dir, &mut pids)?;
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

fn collect(dir: &Path, pids: &mut Vec<u32>) -> Result<(), DiscoveryError> {
    let procs = dir.join("cgroup.procs");
    let text = std::fs::read_to_string(&procs).map_err(|source| DiscoveryError::Read {
        path: procs.clone(),
        source,
    })?;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let pid = line.parse().map_err(|_| DiscoveryError::BadPid {
            path: procs.clone(),
            line: line.to_string(),
        })?;
        pids.push(pid);
    }
    let entries = std::fs::read_dir(dir).map_err(|source| DiscoveryError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            collect(&entry.path(), pids)?;
        }
    }
    Ok(())
}

/// The cgroup directory of `pid`, from `/proc/<pid>/cgroup`.
pub fn cgroup_dir_of_pid(pid: u32, cgroup_root: &Path) -> Result<PathBuf, DiscoveryError> {
    let path = PathBuf::from(format!("/proc/{pid}/cgroup"));
    let text = std::fs::read_to_string(&path).map_err(|source| DiscoveryError::Read {
        path: path.clone(),
        source,
    })?;
    cgroup_dir_from(&text, cgroup_root).ok_or(DiscoveryError::NoCgroup { path })
}

/// Picks a directory from the text of `/proc/<pid>/cgroup` that exists under
/// `cgroup_root`. On v1 (or hybrid) a controller every container has is preferred
/// (`pids`, then `memory`, `freezer`, `cpu`); a pure v2 host has only `0::<path>`.
pub fn cgroup_dir_from(proc_cgroup: &str, cgroup_root: &Path) -> Option<PathBuf> {
    let mut candidates: Vec<(usize, PathBuf)> = Vec::new();
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(rel)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let rel = rel.trim_start_matches('/');
        if controllers.is_empty() {
            // v2: the unified hierarchy is the root itself, or `unified/` on hybrid hosts.
            candidates.push((10, cgroup_root.join("unified").join(rel)));
            candidates.push((11, cgroup_root.join(rel)));
            continue;
        }
        let rank = ["pids", "memory", "freezer", "cpu"]
            .iter()
            .position(|c| controllers.split(',').any(|x| x == *c));
        if let Some(rank) = rank {
            candidates.push((rank, cgroup_root.join(controllers).join(rel)));
        }
    }
    candidates.sort_by_key(|(rank, _)| *rank);
    candidates
        .into_iter()
        .map(|(_, p)| p)
        .find(|p| p.join("cgroup.procs").is_file())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn cg(root: &Path, rel: &str, pids: &str) {
        let d = root.join(rel);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("cgroup.procs"), pids).unwrap();
    }

    #[test]
    fn v2_nested_pids() {
        let root = tempfile::tempdir().unwrap();
        cg(root.path(), "k8s/ctr", "10\n12\n");
        cg(root.path(), "k8s/ctr/sub", "11\n12\n");
        let dir = cgroup_dir_from("0::/k8s/ctr\n", root.path()).unwrap();
        assert_eq!(dir, root.path().join("k8s/ctr"));
        assert_eq!(cgroup_pids(&dir).unwrap(), vec![10, 11, 12]);
    }

    #[test]
    fn v1_hybrid_prefers_pids_controller() {
        let root = tempfile::tempdir().unwrap();
        cg(root.path(), "pids/docker/abc", "7\n");
        cg(root.path(), "cpu,cpuacct/docker/abc", "7\n");
        let text = "12:cpu,cpuacct:/docker/abc\n5:pids:/docker/abc\n0::/docker/abc\n";
        let dir = cgroup_dir_from(text, root.path()).unwrap();
        assert_eq!(dir, root.path().join("pids/docker/abc"));
    }

    #[test]
    fn bad_pid_is_reported() {
        let root = tempfile::tempdir().unwrap();
        cg(root.path(), "x", "12\nabc\n");
        let err = cgroup_pids(&root.path().join("x")).unwrap_err();
        assert!(matches!(err, DiscoveryError::BadPid { .. }), "{err}");
    }

    #[test]
    fn own_cgroup_contains_self() {
        let me = std::process::id();
        if let Ok(dir) = cgroup_dir_of_pid(me, Path::new(CGROUP_ROOT)) {
            assert!(cgroup_pids(&dir).unwrap().contains(&me));
        }
    }
}

/// Environment: `1` makes every process a CUDA candidate (CPU tests, whose fake libcuda
/// decides which pids are CUDA processes).
pub const ALL_PROCESSES_ENV: &str = "GPUCR_GPU_ALL_PROCESSES";

/// Whether `pid` may be a CUDA process: it maps an NVIDIA device node or libcuda (a
/// driver-checkpointed process keeps only libcuda's mappings). A cheap filter before
/// asking the driver, which only answers for CUDA processes anyway.
pub fn is_cuda_candidate(pid: u32) -> bool {
    if std::env::var_os(ALL_PROCESSES_ENV).is_some_and(|v| v == "1") {
        return true;
    }
    std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| maps_cuda(&m))
}

/// Whether a `/proc/<pid>/maps` text shows NVIDIA device nodes or libcuda.
pub fn maps_cuda(maps: &str) -> bool {
    maps.lines()
        .any(|l| l.contains("/dev/nvidia") || l.contains("/libcuda.so"))
}

#[cfg(test)]
mod candidate_tests {
    use super::*;

    #[test]
    fn cuda_mappings_make_a_candidate() {
        let live = "200600000-200800000 rw-s 00000000 00:05 1 /dev/nvidiactl\n";
        let checkpointed =
            "7f00-7f10 r-xp 00000000 fd:01 42 /usr/local/nvidia/lib64/libcuda.so.580.159.04\n";
        assert!(maps_cuda(live));
        assert!(maps_cuda(checkpointed));
        assert!(!maps_cuda(
            "7f00-7f10 r-xp 00000000 fd:01 42 /usr/lib/libc.so.6\n"
        ));
    }
}
