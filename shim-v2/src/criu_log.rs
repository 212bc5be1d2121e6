//! CRIU's and runc's logs, read from their tail with a bound: a CRIU stuck in a loop wrote an
//! 18.8 GB `restore.log` in 90 s, and reading it whole took the shim to gigabytes of RSS.
//! Also the causes an operator can act on (a full disk, no memory), named from the errno
//! texts CRIU logs, instead of CRIU's last `exited, status=2` line.

use std::io::{BufRead, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// How much of a log's end is read: CRIU's error lines are the last ones it writes.
pub const TAIL_BYTES: u64 = 64 * 1024;

/// How much of a restore log's start is searched for the root CRIU forked: it comes after
/// the images are read, before any memory is restored.
pub const HEAD_BYTES: u64 = 4 * 1024 * 1024;

/// The root of the tree a restore forked, as CRIU logs it right after the fork (debug level,
/// which runc asks for): `PID: real <pid on the host> virt <pid in its own namespace>`, from
/// the first [`HEAD_BYTES`] of `log`.
pub fn restored_root(log: &Path) -> Option<(i32, i32)> {
    let f = std::fs::File::open(log).ok()?;
    std::io::BufReader::new(f.take(HEAD_BYTES))
        .split(b'\n')
        .map_while(Result::ok)
        .find_map(|line| {
            let line = String::from_utf8_lossy(&line);
            let mut w = line[line.find("PID: real ")? + "PID: real ".len()..].split_whitespace();
            let real = w.next()?.parse().ok()?;
            let virt = (w.next()? == "virt").then(|| w.next())??.parse().ok()?;
            Some((real, virt))
        })
}

/// The last `max` bytes of `path` (lossy UTF-8), starting at a line boundary.
pub fn tail(path: &Path, max: u64) -> Option<String> {
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let start = len.saturating_sub(max);
    f.seek(SeekFrom::Start(start)).ok()?;
    let mut buf = Vec::with_capacity(max.min(len) as usize);
    f.take(max).read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    // A cut line is dropped: it could be read as something it is not.
    Some(match (start > 0, text.find('\n')) {
        (true, Some(i)) => text[i + 1..].to_string(),
        _ => text,
    })
}

/// What CRIU's log says went wrong, where it is one of the errors an operator fixes on the
/// host rather than in the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    DiskFull,
    QuotaExceeded,
    ReadOnly,
    NoMemory,
}

impl Cause {
    /// The errno texts (strerror) CRIU appends to its failed writes and allocations.
    const TEXTS: [(&'static str, Cause); 4] = [
        ("No space left on device", Cause::DiskFull),
        ("Disk quota exceeded", Cause::QuotaExceeded),
        ("Read-only file system", Cause::ReadOnly),
        ("Cannot allocate memory", Cause::NoMemory),
    ];

    /// The first known cause in CRIU's log text.
    pub fn find(text: &str) -> Option<(Cause, String)> {
        text.lines().find_map(|l| {
            Self::TEXTS
                .iter()
                .find(|(t, _)| l.contains(t))
                .map(|(_, c)| (*c, l.trim().to_string()))
        })
    }

    /// The cause in words for the operator: `dirs` are the checkpoint's image and work
    /// directories (the one with the least free space is named for a full disk).
    pub fn describe(self, dirs: &[&Path]) -> String {
        let fullest = || {
            dirs.iter()
                .filter_map(|d| free_bytes(d).map(|b| (d.to_path_buf(), b)))
                .min_by_key(|(_, b)| *b)
        };
        let at = |what: &str| match fullest() {
            Some((p, b)) => format!("{what}: {}, {b} bytes free", p.display()),
            None => format!("{what}: {}", paths(dirs)),
        };
        match self {
            Cause::DiskFull => at("the checkpoint's disk is full"),
            Cause::QuotaExceeded => at("the checkpoint's disk quota is exceeded"),
            Cause::ReadOnly => {
                format!("the checkpoint's file system is read-only: {}", paths(dirs))
            }
            Cause::NoMemory => {
                "the host ran out of memory (CRIU could not allocate); free memory or raise the \
                 container's memory limit"
                    .to_string()
            }
        }
    }
}

fn paths(dirs: &[&Path]) -> String {
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Bytes an unprivileged writer can still use on `dir`'s file system (its nearest existing
/// ancestor's).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    let existing: PathBuf = dir.ancestors().find(|a| a.exists())?.to_path_buf();
    let st = nix::sys::statvfs::statvfs(&existing).ok()?;
    Some(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// CRIU errors that appear in every run on some hosts and never cause a failure.
const HARMLESS_CRIU_ERRORS: [&str; 1] = ["rlimit: Can't setup RLIMIT_NOFILE for self"];

/// First error line CRIU wrote to a dump or restore log (known-harmless lines skipped), in
/// the log's last `criu_log::TAIL_BYTES`; a line naming an errno an operator can act on
/// (a full disk) wins over CRIU's later `exited, status=2`.
pub fn first_error(log: &Path) -> Option<String> {
    let text = tail(log, TAIL_BYTES)?;
    if let Some((_, line)) = Cause::find(&text) {
        return Some(line);
    }
    text.lines()
        .filter(|l| l.contains("Error (") || l.starts_with("Error"))
        .find(|l| !HARMLESS_CRIU_ERRORS.iter().any(|h| l.contains(h)))
        .map(|l| l.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_is_bounded_and_starts_at_a_line() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("restore.log");
        let mut text = "x".repeat(200_000);
        text.push_str("\nlast line\n");
        std::fs::write(&log, text).unwrap();
        let t = tail(&log, 100).unwrap();
        assert_eq!(t, "last line\n");
        assert!(tail(&log, TAIL_BYTES).unwrap().len() as u64 <= TAIL_BYTES);
    }

    #[test]
    fn the_restored_root_is_read_from_the_log_head() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("restore.log");
        std::fs::write(
            &log,
            "(00.010) Forking task with 1 pid (flags 0x6c028000)\n\
             (00.011) PID: real 4242 virt 1\n\
             (00.012)      1: PID: real 4243 virt 7\n",
        )
        .unwrap();
        assert_eq!(restored_root(&log), Some((4242, 1)));
        std::fs::write(&log, "(00.010) Forking task with 1 pid\n").unwrap();
        assert_eq!(restored_root(&log), None);
        assert_eq!(restored_root(&dir.path().join("none.log")), None);
    }

    #[test]
    fn a_full_disk_is_named_with_its_free_bytes() {
        let text = "(00.1) Error (criu/image.c:123): Can't write: No space left on device\n\
                    (00.2) Error (criu/util.c:656): exited, status=2\n";
        let (cause, line) = Cause::find(text).unwrap();
        assert_eq!(cause, Cause::DiskFull);
        assert!(line.contains("image.c"));
        let dir = tempfile::tempdir().unwrap();
        let msg = cause.describe(&[dir.path()]);
        assert!(msg.starts_with("the checkpoint's disk is full: "), "{msg}");
        assert!(msg.ends_with(" bytes free"), "{msg}");
    }

    #[test]
    fn criu_error_line_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("dump.log");
        std::fs::write(
            &log,
            "(00.001) Version: 4.1\n(00.04) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n(00.2) Error (criu/proc_parse.c:632): Can't handle non-regular mapping\n(00.3) Error (x): later\n",
        )
        .unwrap();
        assert_eq!(
            first_error(&log).unwrap(),
            "(00.2) Error (criu/proc_parse.c:632): Can't handle non-regular mapping"
        );
    }
}
