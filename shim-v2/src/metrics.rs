//! The node's checkpoint and restore metrics and event log, written by every shim after each
//! checkpoint and restore: `gpucr.prom` for node-exporter's textfile collector (durations as
//! histograms, bytes, outcomes) and `events.jsonl`, one JSON line per operation.
//!
//! There is one shim per container, so the totals live in `state.json` beside them and every
//! update is a read-modify-write under an flock. Metrics never fail an RPC: an error is logged.
//!
//! Directory: `GPUCR_METRICS_DIR` in containerd's environment, default `/var/lib/gpucr/metrics`;
//! `off` turns it off.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

pub const METRICS_DIR_ENV: &str = "GPUCR_METRICS_DIR";
const DEFAULT_DIR: &str = "/var/lib/gpucr/metrics";
/// The event log is rotated to `events.jsonl.1` past this size.
const EVENTS_MAX: u64 = 8 << 20;
/// Upper bounds (seconds) of the duration histograms: a CPU container's checkpoint takes well
/// under a second, a 140 GB GPU one minutes.
const BUCKETS: [f64; 12] = [
    0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Checkpoint,
    Restore,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Checkpoint => "checkpoint",
            Op::Restore => "restore",
        }
    }
}

/// One finished operation.
#[derive(Debug, Clone, Serialize)]
pub struct Event<'a> {
    pub op: Op,
    pub container: &'a str,
    pub namespace: &'a str,
    /// The checkpoint directory written or read.
    pub image: &'a Path,
    pub seconds: f64,
    /// Bytes of the checkpoint image (0 when it failed before there was one).
    pub bytes: u64,
    /// `None`: it succeeded; else the error as the client saw it.
    pub error: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Totals {
    ok: u64,
    failed: u64,
    seconds_sum: f64,
    bytes_sum: u64,
    /// Successful operations per bucket of [`BUCKETS`] (not cumulative), then one for +Inf.
    buckets: Vec<u64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    ops: BTreeMap<Op, Totals>,
}

/// Where metrics go, or `None` when they are off.
pub fn dir() -> Option<PathBuf> {
    match std::env::var_os(METRICS_DIR_ENV) {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => Some(PathBuf::from(DEFAULT_DIR)),
    }
}

/// Records `event`, logging (not returning) any failure.
pub fn record(event: &Event<'_>) {
    let Some(dir) = dir() else { return };
    if let Err(e) = record_in(&dir, event, SystemTime::now()) {
        tracing::warn!(id = event.container, dir = %dir.display(), "metrics not written: {e}");
    }
}

/// The bytes of every file below `dir` (a checkpoint image), 0 when it is not readable.
pub fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => dirs.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

pub fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn record_in(dir: &Path, event: &Event<'_>, now: SystemTime) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))?;
    let _lock = Flock::lock(lock, FlockArg::LockExclusive)
        .map_err(|(_, e)| std::io::Error::from_raw_os_error(e as i32))?;

    let state_path = dir.join("state.json");
    // A damaged state (a crash mid-write cannot cause one: it is renamed into place) restarts
    // the counters rather than stopping metrics for good.
    let mut state: State = fs::read(&state_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let t = state.ops.entry(event.op).or_default();
    t.buckets.resize(BUCKETS.len() + 1, 0);
    if event.error.is_none() {
        t.ok += 1;
        t.seconds_sum += event.seconds;
        t.bytes_sum += event.bytes;
        let i = BUCKETS
            .iter()
            .position(|b| event.seconds <= *b)
            .unwrap_or(BUCKETS.len());
        t.buckets[i] += 1;
    } else {
        t.failed += 1;
    }
    replace(&state_path, &serde_json::to_vec(&state)?)?;
    replace(&dir.join("gpucr.prom"), render(&state).as_bytes())?;

    let events = dir.join("events.jsonl");
    if fs::metadata(&events).is_ok_and(|m| m.len() > EVENTS_MAX) {
        fs::rename(&events, dir.join("events.jsonl.1"))?;
    }
    let mut line = serde_json::to_value(event)?;
    line["time_unix_ms"] = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
        .into();
    let mut f = OpenOptions::new().create(true).append(true).open(&events)?;
    f.write_all(format!("{line}\n").as_bytes())
}

/// Writes `bytes` under a temporary name and renames it over `path`: readers (node-exporter)
/// never see half a file.
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    fs::rename(&tmp, path)
}

fn render(state: &State) -> String {
    let mut out = String::new();
    for op in [Op::Checkpoint, Op::Restore] {
        let empty = Totals::default();
        let t = state.ops.get(&op).unwrap_or(&empty);
        let n = op.name();
        out += &format!(
            "# HELP gpucr_{n}_duration_seconds Time of successful {n}s on this node, as the shim \
             measured them.\n# TYPE gpucr_{n}_duration_seconds histogram\n"
        );
        let mut cumulative = 0;
        for (i, le) in BUCKETS.iter().enumerate() {
            cumulative += t.buckets.get(i).copied().unwrap_or(0);
            out += &format!("gpucr_{n}_duration_seconds_bucket{{le=\"{le}\"}} {cumulative}\n");
        }
        cumulative += t.buckets.get(BUCKETS.len()).copied().unwrap_or(0);
        out += &format!("gpucr_{n}_duration_seconds_bucket{{le=\"+Inf\"}} {cumulative}\n");
        out += &format!("gpucr_{n}_duration_seconds_sum {}\n", t.seconds_sum);
        out += &format!("gpucr_{n}_duration_seconds_count {}\n", t.ok);
        out += &format!(
            "# HELP gpucr_{n}s_total {n}s on this node by outcome.\n# TYPE gpucr_{n}s_total counter\n"
        );
        out += &format!("gpucr_{n}s_total{{outcome=\"ok\"}} {}\n", t.ok);
        out += &format!("gpucr_{n}s_total{{outcome=\"failed\"}} {}\n", t.failed);
        out += &format!(
            "# HELP gpucr_{n}_bytes_total Bytes of checkpoint images of successful {n}s.\n\
             # TYPE gpucr_{n}_bytes_total counter\ngpucr_{n}_bytes_total {}\n",
            t.bytes_sum
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(op: Op, seconds: f64, error: Option<&str>) -> Event<'static> {
        Event {
            op,
            container: "c1",
            namespace: "default",
            image: Path::new("/ckpt"),
            seconds,
            bytes: 1000,
            error: error.map(str::to_string),
        }
    }

    #[test]
    fn shims_add_up_into_one_textfile_and_one_log() {
        let dir = tempfile::tempdir().unwrap();
        let now = SystemTime::now();
        record_in(dir.path(), &event(Op::Checkpoint, 0.4, None), now).unwrap();
        record_in(dir.path(), &event(Op::Checkpoint, 12.0, None), now).unwrap();
        record_in(
            dir.path(),
            &event(Op::Checkpoint, 3.0, Some("CRIU failed")),
            now,
        )
        .unwrap();
        record_in(dir.path(), &event(Op::Restore, 700.0, None), now).unwrap();
        let prom = fs::read_to_string(dir.path().join("gpucr.prom")).unwrap();
        for line in [
            "gpucr_checkpoint_duration_seconds_bucket{le=\"0.5\"} 1",
            "gpucr_checkpoint_duration_seconds_bucket{le=\"20\"} 2",
            "gpucr_checkpoint_duration_seconds_bucket{le=\"+Inf\"} 2",
            "gpucr_checkpoint_duration_seconds_count 2",
            "gpucr_checkpoints_total{outcome=\"failed\"} 1",
            "gpucr_checkpoint_bytes_total 2000",
            "gpucr_restore_duration_seconds_bucket{le=\"600\"} 0",
            "gpucr_restore_duration_seconds_bucket{le=\"+Inf\"} 1",
        ] {
            assert!(prom.lines().any(|l| l == line), "{line} not in\n{prom}");
        }
        let log = fs::read_to_string(dir.path().join("events.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[2]["error"], "CRIU failed");
        assert_eq!(lines[3]["op"], "restore");
        assert!(lines[0]["time_unix_ms"].as_u64().unwrap() > 0);
    }
}
