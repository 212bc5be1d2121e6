//! The node's event log: one JSON line per checkpoint and restore, appended by every shim
//! (`GPUCR_EVENT_LOG`, default [`DEFAULT_EVENT_LOG`]) and read by `gpucr events`.
//!
//! Each line goes out in one `write` on an `O_APPEND` descriptor, so lines of concurrent shims
//! never interleave. Past [`ROTATE_AT`] bytes the log is renamed to `<log>.1` (the previous
//! `.1` goes), under an flock of `<log>.lock` so that two shims never rotate twice.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::fcntl::FlockArg;
use serde::{Deserialize, Serialize};

use crate::error::{io, Result};
use crate::store::lock_file;

/// Shim environment and the CLI's `--log` default: the event log; empty or `off`: none.
pub const EVENT_LOG_ENV: &str = "GPUCR_EVENT_LOG";
pub const DEFAULT_EVENT_LOG: &str = "/var/lib/gpucr/events.jsonl";
pub const ROTATE_AT: u64 = 8 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Checkpoint,
    Restore,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Checkpoint => "checkpoint",
            Kind::Restore => "restore",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Ok,
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
        }
    }
}

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// UTC, RFC 3339 with milliseconds.
    pub time: String,
    pub time_unix_ms: u64,
    pub container: String,
    #[serde(default)]
    pub namespace: String,
    pub kind: Kind,
    pub result: Outcome,
    /// Where the checkpoint's large files are: `inline`, `local` or `shared`.
    pub mode: String,
    pub duration_ms: u64,
    /// The checkpoint image's bytes, those in the node's store included (0 when it failed).
    pub bytes: u64,
    /// New chunk bytes written to the node's store, sent to and fetched from the shared store.
    #[serde(default)]
    pub store_written_bytes: u64,
    #[serde(default)]
    pub store_pushed_bytes: u64,
    #[serde(default)]
    pub store_pulled_bytes: u64,
    /// GPU device memory in the image.
    #[serde(default)]
    pub gpu_bytes: u64,
    /// The checkpoint directory written or read.
    #[serde(default)]
    pub image: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The log's path from the environment; `None` when it is off.
pub fn log_path() -> Option<PathBuf> {
    path_from_env(EVENT_LOG_ENV, DEFAULT_EVENT_LOG)
}

/// A node file's path from environment variable `var`: `default` when unset, `None` when
/// empty or `off`.
pub fn path_from_env(var: &str, default: &str) -> Option<PathBuf> {
    match std::env::var_os(var) {
        Some(v) if v.is_empty() || v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => Some(PathBuf::from(default)),
    }
}

/// `time` for [`Event::time`] and its milliseconds since the epoch.
pub fn timestamp(time: SystemTime) -> (String, u64) {
    let ms = time
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default();
    (rfc3339_utc(ms), ms)
}

/// Appends `event` to the log at `path`, rotating it first when it is past [`ROTATE_AT`].
pub fn append(path: &Path, event: &Event) -> Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)
            .map_err(io("cannot create the event log's directory", parent))?;
    }
    if fs::metadata(path).is_ok_and(|m| m.len() >= ROTATE_AT) {
        rotate(path)?;
    }
    let mut line = serde_json::to_vec(event).expect("an event serialises");
    line.push(b'\n');
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io("cannot open the event log", path))?;
    // One write: a regular file takes it whole, so concurrent appenders do not interleave.
    f.write_all(&line)
        .map_err(io("cannot append to the event log", path))
}

fn rotate(path: &Path) -> Result<()> {
    let _held = lock_file(&sibling(path, ".lock"), FlockArg::LockExclusive)?;
    // Another shim may have rotated while this one waited.
    if fs::metadata(path).is_ok_and(|m| m.len() >= ROTATE_AT) {
        let old = sibling(path, ".1");
        fs::rename(path, &old).map_err(io("cannot rotate the event log to", &old))?;
    }
    Ok(())
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The last `n` events (all with `None`), oldest first, from the rotated log and the current
/// one. Lines that do not parse (a crash mid-write, a newer gpucr's fields) are skipped and
/// counted in the second value.
pub fn read_last(path: &Path, n: Option<usize>) -> Result<(Vec<Event>, usize)> {
    let mut events = Vec::new();
    let mut skipped = 0;
    for p in [sibling(path, ".1"), path.to_path_buf()] {
        let text = match fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io("cannot read the event log", &p)(e)),
        };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str(line) {
                Ok(e) => events.push(e),
                Err(_) => skipped += 1,
            }
        }
    }
    if let Some(n) = n {
        let drop = events.len().saturating_sub(n);
        events.drain(..drop);
    }
    Ok((events, skipped))
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` of `ms` since the epoch.
fn rfc3339_utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (counted in 400-year eras, which
/// repeat exactly).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of the era, 0..146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of the era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year from March 1st
    let mp = (5 * doy + 2) / 153; // month from March, 0..11
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(container: &str, kind: Kind, error: Option<&str>) -> Event {
        let (time, time_unix_ms) = timestamp(SystemTime::now());
        Event {
            time,
            time_unix_ms,
            container: container.into(),
            namespace: "default".into(),
            kind,
            result: if error.is_some() {
                Outcome::Error
            } else {
                Outcome::Ok
            },
            mode: "local".into(),
            duration_ms: 1500,
            bytes: 4096,
            store_written_bytes: 0,
            store_pushed_bytes: 0,
            store_pulled_bytes: 0,
            gpu_bytes: 0,
            image: "/ckpt".into(),
            error: error.map(str::to_string),
        }
    }

    #[test]
    fn times_are_utc_dates() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339_utc(1_767_225_599_999), "2025-12-31T23:59:59.999Z");
        assert_eq!(rfc3339_utc(4_107_542_400_000), "2100-03-01T00:00:00.000Z");
    }

    #[test]
    fn appended_lines_read_back_last_first_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sub/events.jsonl");
        append(&log, &event("a", Kind::Checkpoint, None)).unwrap();
        append(&log, &event("a", Kind::Restore, Some("CRIU failed"))).unwrap();
        append(&log, &event("b", Kind::Checkpoint, None)).unwrap();
        let (all, skipped) = read_last(&log, None).unwrap();
        assert_eq!((all.len(), skipped), (3, 0));
        assert_eq!(all[1].error.as_deref(), Some("CRIU failed"));
        assert_eq!(all[1].result, Outcome::Error);
        let (last, _) = read_last(&log, Some(2)).unwrap();
        assert_eq!(last[0].kind, Kind::Restore);
        assert_eq!(last[1].container, "b");
        let text = fs::read_to_string(&log).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["kind"], "checkpoint");
        assert_eq!(first["result"], "ok");
        assert!(first.get("error").is_none(), "{first}");
        assert!(read_last(&dir.path().join("none"), None)
            .unwrap()
            .0
            .is_empty());
    }

    #[test]
    fn concurrent_appenders_never_interleave_and_rotation_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("events.jsonl");
        // A long error makes each line big, so rotation happens while threads append.
        let long = "x".repeat(64 << 10);
        std::thread::scope(|s| {
            for t in 0..8 {
                let (log, long) = (&log, &long);
                s.spawn(move || {
                    for i in 0..40 {
                        let e = event(&format!("t{t}-{i}"), Kind::Checkpoint, Some(long));
                        append(log, &e).unwrap();
                    }
                });
            }
        });
        let (events, skipped) = read_last(&log, None).unwrap();
        assert_eq!(skipped, 0, "a torn line");
        assert!(sibling(&log, ".1").exists(), "rotated");
        // Everything since the last rotation is there: the current log holds whole lines.
        let current = fs::read_to_string(&log).unwrap();
        assert!(current.lines().all(|l| l.ends_with('}')));
        assert!(!events.is_empty() && events.len() <= 320);
    }
}
