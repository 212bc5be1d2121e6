//! OOM notifications for TaskOOM events: cgroup v2 through inotify on `memory.events`
//! (`oom_kill` growing), cgroup v1 through an eventfd registered on `memory.oom_control`.
//! One small thread per container; it ends when the container's cgroup goes away.

use std::{
    fs,
    io::Read,
    os::fd::{AsFd, AsRawFd, FromRawFd},
    path::{Path, PathBuf},
};

use nix::sys::{
    eventfd::{EfdFlags, EventFd},
    inotify::{AddWatchFlags, InitFlags, Inotify},
};
use tokio::sync::mpsc::UnboundedSender;

/// The memory cgroup directory of `pid`.
fn memory_cgroup(pid: u32) -> Option<(PathBuf, bool)> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
        return Some((
            Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/')),
            true,
        ));
    }
    let rel = text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    })?;
    Some((
        Path::new("/sys/fs/cgroup/memory").join(rel.trim_start_matches('/')),
        false,
    ))
}

fn oom_kills(events: &Path) -> Option<u64> {
    fs::read_to_string(events)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
}

/// Starts watching the memory cgroup of `pid`; each OOM kill sends `id` on `tx`.
pub fn watch(id: String, pid: u32, tx: UnboundedSender<String>) {
    let Some((dir, v2)) = memory_cgroup(pid) else {
        tracing::debug!(id, pid, "no memory cgroup to watch for OOM");
        return;
    };
    let spawned = std::thread::Builder::new()
        .name(format!("oom-{id}"))
        .spawn(move || {
            let res = if v2 {
                watch_v2(&id, &dir, &tx)
            } else {
                watch_v1(&id, &dir, &tx)
            };
            if let Err(e) = res {
                tracing::debug!(id, cgroup = %dir.display(), "OOM watch ended: {e}");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start OOM watcher: {e}");
    }
}

fn watch_v2(id: &str, dir: &Path, tx: &UnboundedSender<String>) -> nix::Result<()> {
    let events = dir.join("memory.events");
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC)?;
    inotify.add_watch(&events, AddWatchFlags::IN_MODIFY)?;
    let mut seen = oom_kills(&events).unwrap_or(0);
    loop {
        let evs = inotify.read_events()?;
        if evs
            .iter()
            .any(|e| e.mask.contains(AddWatchFlags::IN_IGNORED))
        {
            return Ok(()); // the cgroup was removed
        }
        let Some(now) = oom_kills(&events) else {
            return Ok(());
        };
        if now > seen {
            seen = now;
            if tx.send(id.to_string()).is_err() {
                return Ok(());
            }
        }
    }
}

fn watch_v1(id: &str, dir: &Path, tx: &UnboundedSender<String>) -> nix::Result<()> {
    let control = fs::File::open(dir.join("memory.oom_control")).map_err(io_errno)?;
    let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)?;
    let line = format!("{} {}", efd.as_fd().as_raw_fd(), control.as_raw_fd());
    fs::write(dir.join("cgroup.event_control"), line).map_err(io_errno)?;
    // SAFETY: a dup of the eventfd we own, read as a plain file.
    let dup = nix::unistd::dup(efd.as_fd())?;
    let mut reader = unsafe { fs::File::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(dup)) };
    let mut buf = [0u8; 8];
    loop {
        reader.read_exact(&mut buf).map_err(io_errno)?;
        // The eventfd also fires when the cgroup is removed.
        if !dir.exists() {
            return Ok(());
        }
        if tx.send(id.to_string()).is_err() {
            return Ok(());
        }
    }
}

fn io_errno(e: std::io::Error) -> nix::errno::Errno {
    nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_memory_cgroup_is_found() {
        // Every process has one on a host with the memory controller.
        if let Some((dir, _)) = memory_cgroup(std::process::id()) {
            assert!(dir.starts_with("/sys/fs/cgroup"));
        }
    }

    #[test]
    fn oom_kill_count_is_parsed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("memory.events");
        fs::write(&p, "low 0\nhigh 0\nmax 3\noom 2\noom_kill 1\n").unwrap();
        assert_eq!(oom_kills(&p), Some(1));
    }
}
