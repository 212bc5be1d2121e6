//! The node's checkpoint and restore metrics and event log, written by every shim after each
//! checkpoint and restore (a restore from its Create to its Start), whatever its mode and
//! outcome:
//! - a node-exporter textfile ([`TEXTFILE_ENV`], default [`DEFAULT_TEXTFILE`]): counts by
//!   mode and result, duration histograms, image, GPU and store bytes;
//! - a line in the event log (`gpucr_store::events`, `GPUCR_EVENT_LOG`), which `gpucr events`
//!   reads.
//!
//! There is one shim per container (or pod), so the totals live in a state file beside the
//! textfile and every update is a read-modify-write under an flock; the textfile is rewritten
//! whole through a temporary file and a rename, so node-exporter never reads half of it.
//! Metrics never fail an RPC: an error is logged as a warning.
//!
//! The text is written here rather than through a Prometheus client crate: the textfile
//! collector reads the Prometheus text format, not OpenMetrics (what `prometheus-client`
//! encodes), and the values are totals summed across processes, not a registry's own.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use gpucr_store::error::io;
use gpucr_store::events::{self, Kind, Outcome};
use gpucr_store::store::lock_file;
use gpucr_store::{DirRef, RefMode};
use nix::fcntl::FlockArg;
use serde::{Deserialize, Serialize};

use crate::by_reference::Mode;

/// Shim environment: the textfile; empty or `off`: no metrics.
pub const TEXTFILE_ENV: &str = "GPUCR_METRICS_TEXTFILE";
pub const DEFAULT_TEXTFILE: &str = "/var/lib/gpucr/metrics/gpucr.prom";
/// Upper bounds (seconds) of the duration histograms: a CPU container's checkpoint takes well
/// under a second, a GPU one with 100+ GB of device memory minutes.
const BUCKETS: [f64; 12] = [
    0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
const MODES: [&str; 3] = ["inline", "local", "shared"];
const KINDS: [Kind; 2] = [Kind::Checkpoint, Kind::Restore];

/// What the store moved for one operation, noted by `by_reference` as it goes (the checkpoint
/// and restore verbs return no figures).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StoreBytes {
    /// New chunk bytes written to the node's store.
    pub written: u64,
    pub pushed: u64,
    pub pulled: u64,
}

/// Per container: one checkpoint or restore runs at a time for a container.
static STORE_NOTES: Mutex<BTreeMap<String, StoreBytes>> = Mutex::new(BTreeMap::new());

/// Adds to container `id`'s current operation's store figures.
pub fn note_store(id: &str, f: impl FnOnce(&mut StoreBytes)) {
    f(STORE_NOTES
        .lock()
        .expect("store notes lock")
        .entry(id.to_string())
        .or_default());
}

/// Container `id`'s operation begins: figures of an earlier one that was never recorded go.
pub fn begin(id: &str) {
    STORE_NOTES.lock().expect("store notes lock").remove(id);
}

fn take_store(id: &str) -> StoreBytes {
    STORE_NOTES
        .lock()
        .expect("store notes lock")
        .remove(id)
        .unwrap_or_default()
}

pub fn mode_label(mode: Mode) -> &'static str {
    match mode {
        Mode::Inline => "inline",
        Mode::Local => "local",
        Mode::Shared => "shared",
    }
}

/// A restore's mode, read from its image before Create puts the files back.
pub fn image_mode(image: &Path) -> &'static str {
    match DirRef::read(image) {
        Ok(Some(r)) => match r.mode {
            RefMode::Local => "local",
            RefMode::Shared => "shared",
        },
        _ => "inline",
    }
}

/// One finished checkpoint or restore.
#[derive(Debug, Clone)]
pub struct Operation<'a> {
    pub kind: Kind,
    pub container: &'a str,
    pub namespace: &'a str,
    pub image: &'a Path,
    pub mode: &'static str,
    pub duration: Duration,
    /// The image's bytes, those in the store included (0 when it failed).
    pub bytes: u64,
    /// GPU device memory in the image.
    pub gpu_bytes: u64,
    /// `None`: it succeeded; else the error as the client saw it.
    pub error: Option<String>,
}

/// Where the textfile goes, or `None` when metrics are off.
pub fn textfile() -> Option<PathBuf> {
    events::path_from_env(TEXTFILE_ENV, DEFAULT_TEXTFILE)
}

/// Records `op` in the textfile and the event log, logging (never returning) a failure.
pub fn record(op: &Operation<'_>) {
    let store = take_store(op.container);
    if let Some(path) = textfile() {
        if let Err(e) = update_textfile(&path, op, &store) {
            tracing::warn!(id = op.container, "metrics not written: {e}");
        }
    }
    if let Some(path) = events::log_path() {
        if let Err(e) = events::append(&path, &event(op, &store, SystemTime::now())) {
            tracing::warn!(id = op.container, "event not logged: {e}");
        }
    }
}

fn event(op: &Operation<'_>, store: &StoreBytes, now: SystemTime) -> events::Event {
    let (time, time_unix_ms) = events::timestamp(now);
    events::Event {
        time,
        time_unix_ms,
        container: op.container.to_string(),
        namespace: op.namespace.to_string(),
        kind: op.kind,
        result: outcome(op),
        mode: op.mode.to_string(),
        duration_ms: op.duration.as_millis() as u64,
        bytes: op.bytes,
        store_written_bytes: store.written,
        store_pushed_bytes: store.pushed,
        store_pulled_bytes: store.pulled,
        gpu_bytes: op.gpu_bytes,
        image: op.image.to_path_buf(),
        error: op.error.clone(),
    }
}

fn outcome(op: &Operation<'_>) -> Outcome {
    if op.error.is_some() {
        Outcome::Error
    } else {
        Outcome::Ok
    }
}

/// The bytes of a checkpoint image: its files, and those it holds by reference in the store.
pub fn image_bytes(image: &Path) -> u64 {
    let referenced = DirRef::read(image).ok().flatten().map_or(0, |r| r.bytes());
    tree_bytes(image) + referenced
}

fn tree_bytes(dir: &Path) -> u64 {
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

/// The GPU device memory an image holds: what the hook moved and the driver path's estimate.
pub fn gpu_bytes(image: &Path) -> u64 {
    let Ok(r) = crate::records::Records::read(image) else {
        return 0;
    };
    let hook = r.hook.map_or(0, |h| h.device_bytes());
    let driver: u64 = r.gpu.map_or(0, |g| {
        g.processes
            .iter()
            .filter_map(|p| p.device_memory_estimate_bytes())
            .sum()
    });
    hook + driver
}

/// Totals of one kind and mode, summed over the node's shims.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Totals {
    ok: u64,
    error: u64,
    /// Successful operations only, as the histogram.
    seconds_sum: f64,
    /// Successful operations per bucket of [`BUCKETS`] (not cumulative), then one for +Inf.
    buckets: Vec<u64>,
    bytes: u64,
    gpu_bytes: u64,
    store_written: u64,
    store_pushed: u64,
    store_pulled: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    /// By `<kind>/<mode>`.
    totals: BTreeMap<String, Totals>,
}

fn key(kind: Kind, mode: &str) -> String {
    format!("{}/{mode}", kind.as_str())
}

impl State {
    fn add(&mut self, op: &Operation<'_>, store: &StoreBytes) {
        let t = self.totals.entry(key(op.kind, op.mode)).or_default();
        t.buckets.resize(BUCKETS.len() + 1, 0);
        // Bytes the store moved count whether or not the operation succeeded.
        t.store_written += store.written;
        t.store_pushed += store.pushed;
        t.store_pulled += store.pulled;
        if op.error.is_some() {
            t.error += 1;
            return;
        }
        let secs = op.duration.as_secs_f64();
        t.ok += 1;
        t.seconds_sum += secs;
        t.bytes += op.bytes;
        t.gpu_bytes += op.gpu_bytes;
        let i = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        t.buckets[i] += 1;
    }

    fn get(&self, kind: Kind, mode: &str) -> Totals {
        self.totals
            .get(&key(kind, mode))
            .cloned()
            .unwrap_or_default()
    }

    fn sum(&self, f: impl Fn(&Totals) -> u64) -> u64 {
        self.totals.values().map(f).sum()
    }
}

/// Adds `op` to the node's totals and rewrites the textfile at `path`.
fn update_textfile(path: &Path, op: &Operation<'_>, store: &StoreBytes) -> gpucr_store::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io("cannot create the metrics directory", dir))?;
    let _held = lock_file(&hidden(path, "lock"), FlockArg::LockExclusive)?;
    let state_path = hidden(path, "state.json");
    // A state file that does not parse (it is renamed into place, so not a crash mid-write;
    // an older format) restarts the counters rather than stopping metrics for good.
    let mut state: State = fs::read(&state_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    state.add(op, store);
    let json = serde_json::to_vec(&state).expect("metrics state serialises");
    replace(&state_path, &json)?;
    replace(path, render(&state).as_bytes())
}

/// `.<name>.<suffix>` beside `path`: node-exporter reads only `*.prom`, and hidden names keep
/// the directory readable.
fn hidden(path: &Path, suffix: &str) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "gpucr.prom".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.{suffix}"))
}

/// Writes `bytes` under a temporary name and renames it over `path`.
fn replace(path: &Path, bytes: &[u8]) -> gpucr_store::Result<()> {
    let tmp = hidden(path, "tmp");
    let mut f = File::create(&tmp).map_err(io("cannot create", &tmp))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io("cannot write", &tmp))?;
    fs::rename(&tmp, path).map_err(io("cannot rename into place", path))
}

/// The Prometheus text format (0.0.4) of `state`; every series is present from the first
/// update on, at 0 where nothing happened.
fn render(state: &State) -> String {
    let mut out = String::new();
    for kind in KINDS {
        let k = kind.as_str();
        family(
            &mut out,
            &format!("gpucr_{k}s_total"),
            "counter",
            &format!("{k}s on this node by store mode and result."),
        );
        for mode in MODES {
            let t = state.get(kind, mode);
            for (result, n) in [("ok", t.ok), ("error", t.error)] {
                let _ = writeln!(
                    out,
                    "gpucr_{k}s_total{{mode=\"{mode}\",result=\"{result}\"}} {n}"
                );
            }
        }
        let name = format!("gpucr_{k}_duration_seconds");
        family(
            &mut out,
            &name,
            "histogram",
            &format!("Time of successful {k}s on this node, as the shim measured it."),
        );
        for mode in MODES {
            let t = state.get(kind, mode);
            let mut cumulative = 0;
            for (i, le) in BUCKETS.iter().enumerate() {
                cumulative += t.buckets.get(i).copied().unwrap_or(0);
                let _ = writeln!(
                    out,
                    "{name}_bucket{{mode=\"{mode}\",le=\"{le}\"}} {cumulative}"
                );
            }
            cumulative += t.buckets.get(BUCKETS.len()).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "{name}_bucket{{mode=\"{mode}\",le=\"+Inf\"}} {cumulative}\n\
                 {name}_sum{{mode=\"{mode}\"}} {}\n{name}_count{{mode=\"{mode}\"}} {}",
                t.seconds_sum, t.ok
            );
        }
        let name = format!("gpucr_{k}_bytes_total");
        family(
            &mut out,
            &name,
            "counter",
            &format!(
                "Bytes of the checkpoint images of successful {k}s, those held in the store \
                 included."
            ),
        );
        for mode in MODES {
            let _ = writeln!(
                out,
                "{name}{{mode=\"{mode}\"}} {}",
                state.get(kind, mode).bytes
            );
        }
    }
    family(
        &mut out,
        "gpucr_gpu_bytes_total",
        "counter",
        "GPU device memory in the images of successful checkpoints and restores.",
    );
    for kind in KINDS {
        let n: u64 = MODES.iter().map(|m| state.get(kind, m).gpu_bytes).sum();
        let _ = writeln!(
            out,
            "gpucr_gpu_bytes_total{{kind=\"{}\"}} {n}",
            kind.as_str()
        );
    }
    for (name, help, n) in [
        (
            "gpucr_store_written_bytes_total",
            "New chunk bytes checkpoints wrote to the node's store.",
            state.sum(|t| t.store_written),
        ),
        (
            "gpucr_store_pushed_bytes_total",
            "Chunk bytes checkpoints sent to the shared store.",
            state.sum(|t| t.store_pushed),
        ),
        (
            "gpucr_store_pulled_bytes_total",
            "Chunk bytes restores fetched from the shared store.",
            state.sum(|t| t.store_pulled),
        ),
    ] {
        family(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name} {n}");
    }
    out
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHILD_ENV: &str = "GPUCR_TEST_METRICS_CHILD";
    const PER_WRITER: u64 = 20;

    fn op(kind: Kind, mode: &'static str, secs: f64, error: Option<&str>) -> Operation<'static> {
        Operation {
            kind,
            container: "c1",
            namespace: "default",
            image: Path::new("/ckpt"),
            mode,
            duration: Duration::from_secs_f64(secs),
            bytes: 1000,
            gpu_bytes: 300,
            error: error.map(str::to_string),
        }
    }

    /// Parses the text format as a scraper would: every line a comment or `series value`,
    /// every sample after its family's TYPE, histograms cumulative; the samples by series.
    fn parse(text: &str) -> BTreeMap<String, f64> {
        let mut samples = BTreeMap::new();
        let mut typed = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.push(rest.split(' ').next().unwrap().to_string());
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("series value");
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
            let name = series.split('{').next().unwrap();
            let family = typed.last().expect("a TYPE first");
            assert!(name.starts_with(family.as_str()), "{name} outside {family}");
            if series.contains('{') {
                assert!(series.ends_with('}'), "{line}");
            }
            assert!(
                samples.insert(series.to_string(), value).is_none(),
                "{series} twice"
            );
        }
        assert!(
            samples.contains_key("gpucr_store_pulled_bytes_total"),
            "a whole file ends with the last family:\n{text}"
        );
        for mode in MODES {
            let count =
                samples[&format!("gpucr_checkpoint_duration_seconds_count{{mode=\"{mode}\"}}")];
            let inf = samples[&format!(
                "gpucr_checkpoint_duration_seconds_bucket{{mode=\"{mode}\",le=\"+Inf\"}}"
            )];
            assert_eq!(count, inf);
        }
        samples
    }

    #[test]
    fn the_textfile_sums_operations_by_kind_mode_and_result() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m/gpucr.prom");
        let store = StoreBytes {
            written: 64,
            pushed: 32,
            pulled: 0,
        };
        for o in [
            op(Kind::Checkpoint, "inline", 0.4, None),
            op(Kind::Checkpoint, "inline", 12.0, None),
            op(Kind::Checkpoint, "shared", 3.0, Some("CRIU failed")),
            op(Kind::Restore, "local", 700.0, None),
        ] {
            update_textfile(&path, &o, &store).unwrap();
        }
        let restore = op(Kind::Restore, "shared", 1.0, None);
        let pulled = StoreBytes {
            pulled: 4096,
            ..Default::default()
        };
        update_textfile(&path, &restore, &pulled).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let s = parse(&text);
        let v = |k: &str| {
            s.get(k)
                .copied()
                .unwrap_or_else(|| panic!("{k} in\n{text}"))
        };
        let ck = "gpucr_checkpoint_duration_seconds";
        assert_eq!(
            v(&format!("{ck}_bucket{{mode=\"inline\",le=\"0.5\"}}")),
            1.0
        );
        assert_eq!(v(&format!("{ck}_bucket{{mode=\"inline\",le=\"20\"}}")), 2.0);
        assert_eq!(v(&format!("{ck}_count{{mode=\"inline\"}}")), 2.0);
        assert_eq!(v(&format!("{ck}_sum{{mode=\"inline\"}}")), 12.4);
        assert_eq!(v(&format!("{ck}_count{{mode=\"shared\"}}")), 0.0);
        assert_eq!(
            v("gpucr_checkpoints_total{mode=\"shared\",result=\"error\"}"),
            1.0
        );
        assert_eq!(
            v("gpucr_checkpoints_total{mode=\"inline\",result=\"ok\"}"),
            2.0
        );
        assert_eq!(v("gpucr_checkpoint_bytes_total{mode=\"inline\"}"), 2000.0);
        let rs = "gpucr_restore_duration_seconds";
        assert_eq!(v(&format!("{rs}_bucket{{mode=\"local\",le=\"600\"}}")), 0.0);
        assert_eq!(
            v(&format!("{rs}_bucket{{mode=\"local\",le=\"+Inf\"}}")),
            1.0
        );
        assert_eq!(
            v("gpucr_restores_total{mode=\"shared\",result=\"ok\"}"),
            1.0
        );
        assert_eq!(v("gpucr_gpu_bytes_total{kind=\"checkpoint\"}"), 600.0);
        assert_eq!(v("gpucr_gpu_bytes_total{kind=\"restore\"}"), 600.0);
        // The failed checkpoint's store bytes count too.
        assert_eq!(v("gpucr_store_written_bytes_total"), 4.0 * 64.0);
        assert_eq!(v("gpucr_store_pushed_bytes_total"), 4.0 * 32.0);
        assert_eq!(v("gpucr_store_pulled_bytes_total"), 4096.0);
        // Only the textfile is a .prom file.
        let proms: Vec<_> = fs::read_dir(dir.path().join("m"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".prom"))
            .collect();
        assert_eq!(proms.len(), 1);
    }

    /// Run by [`concurrent_shims_keep_counts_exact`] in child processes; nothing otherwise.
    #[test]
    fn child_writer() {
        let Some(path) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        for _ in 0..PER_WRITER {
            let o = op(Kind::Restore, "local", 0.1, None);
            update_textfile(Path::new(&path), &o, &StoreBytes::default()).unwrap();
        }
    }

    #[test]
    fn concurrent_shims_keep_counts_exact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpucr.prom");
        let (threads, processes) = (4, 3);
        let children: Vec<_> = (0..processes)
            .map(|_| {
                std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", "metrics::tests::child_writer", "--quiet"])
                    .env(CHILD_ENV, &path)
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            // A scraper: whenever the file is there, it parses whole.
            let reader = s.spawn(|| {
                let mut reads = 0;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok(text) = fs::read_to_string(&path) {
                        parse(&text);
                        reads += 1;
                    }
                }
                reads
            });
            let writers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        for _ in 0..PER_WRITER {
                            let o = op(Kind::Checkpoint, "shared", 0.1, None);
                            let store = StoreBytes {
                                written: 1,
                                ..Default::default()
                            };
                            update_textfile(&path, &o, &store).unwrap();
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            for mut c in children {
                assert!(c.wait().unwrap().success(), "a child writer failed");
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(reader.join().unwrap() > 0);
        });
        let s = parse(&fs::read_to_string(&path).unwrap());
        let n = (threads * PER_WRITER) as f64;
        assert_eq!(
            s["gpucr_checkpoints_total{mode=\"shared\",result=\"ok\"}"],
            n
        );
        assert_eq!(s["gpucr_store_written_bytes_total"], n);
        assert_eq!(
            s["gpucr_restores_total{mode=\"local\",result=\"ok\"}"],
            (processes * PER_WRITER) as f64
        );
    }

    #[test]
    fn record_logs_an_event_with_the_store_figures_noted() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("events.jsonl");
        note_store("c9", |b| b.pulled += 10);
        note_store("c9", |b| b.pulled += 5);
        let mut o = op(Kind::Restore, "shared", 2.5, Some("refused"));
        o.container = "c9";
        let store = take_store("c9");
        assert_eq!(store.pulled, 15);
        assert_eq!(take_store("c9"), StoreBytes::default());
        let e = event(&o, &store, SystemTime::now());
        events::append(&log, &e).unwrap();
        let (got, _) = events::read_last(&log, None).unwrap();
        assert_eq!(got.len(), 1);
        let e = &got[0];
        assert_eq!((e.kind, e.result), (Kind::Restore, Outcome::Error));
        assert_eq!((e.mode.as_str(), e.duration_ms), ("shared", 2500));
        assert_eq!(e.store_pulled_bytes, 15);
        assert_eq!(e.error.as_deref(), Some("refused"));
    }

    #[test]
    fn a_by_reference_image_counts_its_stored_bytes() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("inventory.img"), [0u8; 100]).unwrap();
        assert_eq!(image_bytes(dir.path()), 100);
        assert_eq!(image_mode(dir.path()), "inline");
        let r = serde_json::json!({
            "format": gpucr_store::dir::REF_FORMAT, "version": 1, "mode": "shared",
            "store_id": "s", "node": "n", "manifest": "c/1",
            "files": [{"name": "pages-1.img", "size": 5000}],
        });
        let text = serde_json::to_vec(&r).unwrap();
        fs::write(dir.path().join(gpucr_store::dir::REF_FILE), &text).unwrap();
        assert_eq!(image_bytes(dir.path()), 100 + text.len() as u64 + 5000);
        assert_eq!(image_mode(dir.path()), "shared");
    }
}
