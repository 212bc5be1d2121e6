//! Checkpoint/restore benchmark: the same container through `io.containerd.runc.v2` and through
//! gpucr, side by side in one containerd, rounds interleaved; plus the shims' memory and sizes.
//!
//! ```text
//! cargo build --release -p containerd-shim-gpucr-v2
//! GPUCR_SHIM_DIR=$CARGO_TARGET_DIR/release \
//!   cargo run --release -p gpucr-tests --bin bench-checkpoint -- --rounds 10 --out docs/BENCHMARKS.md
//! ```
//!
//! Per round and runtime (the runtime that goes first alternates every round, ABBA…), the
//! counter workload runs detached and warms up, then these `ctr` commands are timed (wall
//! clock of the `ctr` process):
//! - `ctr run -d` (create + start),
//! - `ctr container checkpoint --task --rw`,
//! - after kill, task rm and container rm: `ctr container restore --live --rw`; the counter must
//!   continue from the checkpointed value,
//! - `ctr task checkpoint` (the task keeps running and counting; the stored image must hold a
//!   CRIU tar and is removed with `ctr image rm --sync` afterwards).
//!
//! Then the RSS and PSS (`/proc/<pid>/smaps_rollup`) of the shim serving one container, of the
//! shims serving `--containers` containers (one shim each, and all in one shim grouped by the
//! `io.kubernetes.cri.sandbox-id` annotation that both shims honour), per container; the shim
//! binaries' sizes; and, with `--mem-mib` > 0, checkpoint and restore of a container whose shell
//! holds that much memory.

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpucr_tests::image::MEDIA_CRIU_TAR;
use gpucr_tests::task::{net_host, STATE_TIMEOUT};
use gpucr_tests::{
    counter_args, poll_until, procfs, shim_dir, Cmd, Containerd, GPUCR_RUNTIME, RUNC_RUNTIME,
};

type BoxResult<T> = std::result::Result<T, Box<dyn Error>>;

/// Counter value the workload reaches before each checkpoint.
const WARM_COUNT: u64 = 5;
/// The annotation both shims group containers by.
const GROUP_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";
/// Where new result sections go in docs/BENCHMARKS.md.
const RESULTS_MARKER: &str = "<!-- bench-checkpoint results: newest first -->";

const USAGE: &str = "usage: bench-checkpoint [--rounds N] [--containers N] [--mem-mib N] \
[--mem-rounds N] [--out FILE] [--containerd-log FILE]";

#[derive(Debug, Clone)]
struct Args {
    rounds: usize,
    containers: usize,
    mem_mib: u64,
    mem_rounds: usize,
    out: Option<PathBuf>,
    containerd_log: Option<PathBuf>,
}

impl Args {
    fn parse() -> BoxResult<Self> {
        let mut args = Args {
            rounds: 10,
            containers: 5,
            mem_mib: 256,
            mem_rounds: 3,
            out: None,
            containerd_log: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            if flag == "-h" || flag == "--help" {
                println!("{USAGE}");
                std::process::exit(0);
            }
            let value = it
                .next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
            match flag.as_str() {
                "--rounds" => args.rounds = value.parse()?,
                "--containers" => args.containers = value.parse()?,
                "--mem-mib" => args.mem_mib = value.parse()?,
                "--mem-rounds" => args.mem_rounds = value.parse()?,
                "--out" => args.out = Some(value.into()),
                "--containerd-log" => args.containerd_log = Some(value.into()),
                _ => return Err(format!("unknown flag {flag}\n{USAGE}").into()),
            }
        }
        if args.rounds == 0 || args.containers == 0 {
            return Err("--rounds and --containers must be at least 1".into());
        }
        Ok(args)
    }
}

/// One runtime under comparison.
#[derive(Debug, Clone, Copy)]
struct Runtime {
    name: &'static str,
    short: &'static str,
}

const RUNC: Runtime = Runtime {
    name: RUNC_RUNTIME,
    short: "runc",
};
const GPUCR: Runtime = Runtime {
    name: GPUCR_RUNTIME,
    short: "gpucr",
};
const RUNTIMES: [Runtime; 2] = [RUNC, GPUCR];

/// Samples per (operation, runtime), in milliseconds, in the order operations were first seen.
#[derive(Default)]
struct Timings {
    order: Vec<String>,
    samples: BTreeMap<(String, &'static str), Vec<f64>>,
}

impl Timings {
    fn add(&mut self, op: &str, rt: Runtime, took: Duration) {
        if !self.order.iter().any(|o| o == op) {
            self.order.push(op.to_owned());
        }
        self.samples
            .entry((op.to_owned(), rt.short))
            .or_default()
            .push(took.as_secs_f64() * 1000.0);
    }

    fn get(&self, op: &str, rt: Runtime) -> &[f64] {
        self.samples
            .get(&(op.to_owned(), rt.short))
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }
}

/// The `q` quantile (0..=1) of `samples`, interpolated linearly between closest ranks.
fn quantile(samples: &[f64], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Runs `ctr <args>` (under `timeout`, so that a hung call cannot hang the benchmark) and
/// returns how long it took; fails unless it exits with 0.
fn timed_ctr(ctd: &Containerd, args: &[&str]) -> BoxResult<Duration> {
    let started = Instant::now();
    let out = Command::new("timeout")
        .args(["-k", "5", "300", "ctr", "-a"])
        .arg(ctd.address())
        .args(["-n", ctd.namespace()])
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let took = started.elapsed();
    if !out.status.success() {
        return Err(format!(
            "`ctr {}` failed ({}):\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(took)
}

/// `ctr run -d --runtime <rt>` of `args` in container `id`, timed; output goes to the log file
/// that `Containerd::container_log` reads.
fn run_container(
    ctd: &Containerd,
    rt: Runtime,
    id: &str,
    image: &str,
    args: &[String],
    annotations: &[String],
) -> BoxResult<Duration> {
    let log = format!(
        "--log-uri=file://{}",
        ctd.dir().join(format!("{id}.log")).display()
    );
    let mut argv: Vec<&str> = vec!["run", "-d", "--runtime", rt.name, &log];
    if net_host() {
        argv.push("--net-host");
    }
    for annotation in annotations {
        argv.extend(["--annotation", annotation]);
    }
    argv.extend([image, id]);
    argv.extend(args.iter().map(String::as_str));
    timed_ctr(ctd, &argv)
}

/// Fails unless the restored counter continues from the checkpoint: its first value lies between
/// the last value read before the checkpoint and the first one after it (plus what it can have
/// counted since the restore), and it keeps counting.
fn check_continues(
    ctd: &Containerd,
    id: &str,
    before: u64,
    after: u64,
    restored_at: Instant,
) -> BoxResult<u64> {
    ctd.wait_status(id, "RUNNING")?;
    let first = ctd.wait_counter_above(id, 0)?;
    let slack = restored_at.elapsed().as_millis() as u64 / 150 + 3;
    if first < before || first > after + slack {
        return Err(format!(
            "restored counter of {id} is {first}; checkpointed between {before} and {after} \
             (+{slack} since the restore): the restore did not continue the workload"
        )
        .into());
    }
    Ok(ctd.wait_counter_above(id, first)?)
}

/// Fails unless image `reference`'s index lists a CRIU tar (containerd 1.7 can store a
/// checkpoint image without one).
fn check_has_criu_tar(ctd: &Containerd, reference: &str) -> BoxResult<()> {
    let index: serde_json::Value =
        serde_json::from_slice(&ctd.content(&ctd.image_digest(reference)?)?)?;
    let found = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|d| d["mediaType"] == MEDIA_CRIU_TAR);
    if !found {
        return Err(format!("checkpoint image {reference} holds no CRIU tar").into());
    }
    Ok(())
}

/// RSS and PSS in KiB, from `/proc/<pid>/smaps_rollup`, and the thread count.
#[derive(Debug, Clone, Copy, Default)]
struct Mem {
    rss_kib: u64,
    pss_kib: u64,
    threads: u64,
}

fn mem_of(pid: i32) -> BoxResult<Mem> {
    let rollup = fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))?;
    let field = |text: &str, name: &str| -> u64 {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(Mem {
        rss_kib: field(&rollup, "Rss:"),
        pss_kib: field(&rollup, "Pss:"),
        threads: field(&status, "Threads:"),
    })
}

fn shim_pid(ctd: &Containerd, id: &str) -> BoxResult<i32> {
    let address = ctd.address().to_string_lossy().into_owned();
    procfs::shim_pid(&address, id).ok_or_else(|| format!("no shim process with -id {id}").into())
}

/// Shim processes of this containerd running `binary`.
fn shims_running(ctd: &Containerd, binary: &str) -> Vec<i32> {
    let address = ctd.address().to_string_lossy().into_owned();
    procfs::shims_of(&address)
        .into_iter()
        .filter(|p| {
            p.argv
                .first()
                .is_some_and(|a0| Path::new(a0).file_name().is_some_and(|n| n == binary))
        })
        .map(|p| p.pid)
        .collect()
}

fn shim_binary(rt: Runtime) -> &'static str {
    match rt.short {
        "runc" => "containerd-shim-runc-v2",
        _ => "containerd-shim-gpucr-v2",
    }
}

/// One round of the checkpoint/restore sequence for `rt`; returns the memory of the shim that
/// served the restored container after its restore and task checkpoint.
fn round(
    ctd: &Containerd,
    image: &str,
    rt: Runtime,
    n: usize,
    timings: &mut Timings,
) -> BoxResult<Mem> {
    let id = format!("bench-{}-{n}", rt.short);
    let reference = format!("docker.io/gpucr/bench-{}:{n}", rt.short);

    timings.add(
        "ctr run -d",
        rt,
        run_container(ctd, rt, &id, image, &counter_args(), &[])?,
    );
    ctd.wait_status(&id, "RUNNING")?;
    let before = ctd.wait_counter_above(&id, WARM_COUNT)?;

    // (a) container checkpoint of the task and the rootfs changes; the task keeps running.
    timings.add(
        "ctr container checkpoint --task --rw",
        rt,
        timed_ctr(
            ctd,
            &["container", "checkpoint", "--task", "--rw", &id, &reference],
        )?,
    );
    let after = ctd.read_counter(&id)?;
    check_has_criu_tar(ctd, &reference)?;
    ctd.remove_container(&id)?;

    // (b) live restore into a new container and task.
    let restored_at = Instant::now();
    timings.add(
        "ctr container restore --live --rw",
        rt,
        timed_ctr(
            ctd,
            &["container", "restore", "--live", "--rw", &id, &reference],
        )?,
    );
    let counted = check_continues(ctd, &id, before, after, restored_at)?;
    ctd.remove_image(&reference)?;

    // (c) task checkpoint into the content store, leaving the task running.
    let prefix = gpucr_tests::checkpoint::task_checkpoint_prefix(&id);
    timings.add(
        "ctr task checkpoint",
        rt,
        timed_ctr(ctd, &["task", "checkpoint", &id])?,
    );
    let stored = ctd.images_with_prefix(&prefix)?;
    let [checkpoint] = stored.as_slice() else {
        return Err(format!("`ctr task checkpoint {id}` stored {stored:?}").into());
    };
    check_has_criu_tar(ctd, checkpoint)?;
    ctd.remove_image(checkpoint)?;
    ctd.wait_status(&id, "RUNNING")?;
    ctd.wait_counter_above(&id, counted)?;

    let mem = mem_of(shim_pid(ctd, &id)?)?;
    ctd.remove_container(&id)?;
    Ok(mem)
}

/// (what, memory per container, number of shim processes) rows.
type MemRows = Vec<(String, Mem, usize)>;

/// Memory of `rt`'s shims: (one container, `count` containers one shim each, `count` containers
/// in one group), each as the total over the shims divided by the number of containers, plus
/// the number of shim processes.
fn shim_memory(ctd: &Containerd, image: &str, rt: Runtime, count: usize) -> BoxResult<MemRows> {
    let idle = [
        "sh".to_owned(),
        "-c".into(),
        "while true; do sleep 1; done".into(),
    ];
    let settle = || std::thread::sleep(Duration::from_secs(2));
    let measure = |containers: usize| -> BoxResult<(Mem, usize)> {
        let pids = shims_running(ctd, shim_binary(rt));
        let mut total = Mem::default();
        for pid in &pids {
            let m = mem_of(*pid)?;
            total.rss_kib += m.rss_kib;
            total.pss_kib += m.pss_kib;
            total.threads += m.threads;
        }
        let per = Mem {
            rss_kib: total.rss_kib / containers as u64,
            pss_kib: total.pss_kib / containers as u64,
            threads: total.threads,
        };
        Ok((per, pids.len()))
    };
    let mut rows = Vec::new();
    let mut ids = Vec::new();
    for i in 0..count {
        let id = format!("mem-{}-{i}", rt.short);
        run_container(ctd, rt, &id, image, &idle, &[])?;
        ctd.wait_status(&id, "RUNNING")?;
        ids.push(id);
        if i == 0 {
            settle();
            let (m, shims) = measure(1)?;
            rows.push(("1 container".to_owned(), m, shims));
        }
    }
    if count > 1 {
        settle();
        let (m, shims) = measure(count)?;
        rows.push((format!("{count} containers, a shim each"), m, shims));
    }
    for id in ids.drain(..) {
        ctd.remove_container(&id)?;
    }
    wait_no_shims(ctd, rt)?;

    if count > 1 {
        let annotation = format!("{GROUP_ANNOTATION}=bench-group-{}", rt.short);
        for i in 0..count {
            let id = format!("grp-{}-{i}", rt.short);
            run_container(
                ctd,
                rt,
                &id,
                image,
                &idle,
                std::slice::from_ref(&annotation),
            )?;
            ctd.wait_status(&id, "RUNNING")?;
            ids.push(id);
        }
        settle();
        let (m, shims) = measure(count)?;
        rows.push((format!("{count} containers, one group"), m, shims));
        for id in ids.drain(..) {
            ctd.remove_container(&id)?;
        }
        wait_no_shims(ctd, rt)?;
    }
    Ok(rows)
}

fn wait_no_shims(ctd: &Containerd, rt: Runtime) -> BoxResult<()> {
    poll_until(&format!("{} shims gone", rt.short), STATE_TIMEOUT, || {
        let left = shims_running(ctd, shim_binary(rt));
        Ok(if left.is_empty() { Ok(()) } else { Err(left) })
    })?;
    Ok(())
}

/// Checkpoint and restore of a container whose shell holds `mib` MiB of anonymous memory.
fn memory_round(
    ctd: &Containerd,
    image: &str,
    rt: Runtime,
    n: usize,
    mib: u64,
    timings: &mut Timings,
) -> BoxResult<u64> {
    let id = format!("big-{}-{n}", rt.short);
    let reference = format!("docker.io/gpucr/big-{}:{n}", rt.short);
    // The shell keeps a string of `mib` MiB in a variable, then counts.
    let script = format!(
        "x=$(head -c {} /dev/zero | tr '\\0' a); {}",
        mib << 20,
        gpucr_tests::COUNTER_SCRIPT
    );
    let args = ["sh".to_owned(), "-c".into(), script];
    run_container(ctd, rt, &id, image, &args, &[])?;
    ctd.wait_status(&id, "RUNNING")?;
    let before = poll_until(
        &format!("{id} filled its memory"),
        Duration::from_secs(120),
        || {
            let value = ctd.read_counter(&id)?;
            Ok(if value > 2 { Ok(value) } else { Err(value) })
        },
    )?;
    let op = format!("{mib} MiB: ");
    timings.add(
        &format!("{op}ctr container checkpoint --task --rw"),
        rt,
        timed_ctr(
            ctd,
            &["container", "checkpoint", "--task", "--rw", &id, &reference],
        )?,
    );
    let after = ctd.read_counter(&id)?;
    ctd.remove_container(&id)?;
    let restored_at = Instant::now();
    timings.add(
        &format!("{op}ctr container restore --live --rw"),
        rt,
        timed_ctr(
            ctd,
            &["container", "restore", "--live", "--rw", &id, &reference],
        )?,
    );
    check_continues(ctd, &id, before, after, restored_at)?;
    // The restored shell holds its memory again.
    let rss_kib = mem_of(ctd.task_pid(&id)? as i32)?.rss_kib;
    if rss_kib < (mib << 10) {
        return Err(format!("restored {id} holds only {rss_kib} KiB").into());
    }
    ctd.remove_image(&reference)?;
    ctd.remove_container(&id)?;
    Ok(rss_kib)
}

fn first_line(program: &str, args: &[&str]) -> String {
    Cmd::new(program)
        .args(args)
        .output()
        .ok()
        .and_then(|o| {
            let text = if o.stdout.trim().is_empty() {
                o.stderr
            } else {
                o.stdout
            };
            text.lines().next().map(|l| l.trim().to_owned())
        })
        .unwrap_or_else(|| "?".to_owned())
}

fn cgroup_mode() -> &'static str {
    match Cmd::new("stat")
        .args(["-fc", "%T", "/sys/fs/cgroup"])
        .output()
    {
        Ok(o) if o.stdout.trim() == "cgroup2fs" => "v2 (unified)",
        Ok(_) if Path::new("/sys/fs/cgroup/unified").is_dir() => "v1 (hybrid)",
        Ok(_) => "v1",
        Err(_) => "?",
    }
}

/// The binary's size on disk and stripped (`strip` on a copy), in bytes.
fn binary_sizes(path: &Path) -> BoxResult<(u64, Option<u64>)> {
    let size = fs::metadata(path)?.len();
    let tmp = tempfile::NamedTempFile::new()?;
    let stripped = Cmd::new("strip")
        .arg("-o")
        .arg(tmp.path())
        .arg(path)
        .run_ok()
        .ok()
        .and_then(|_| fs::metadata(tmp.path()).ok())
        .map(|m| m.len());
    Ok((size, stripped))
}

fn find_in_path(binary: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(binary))
        .find(|p| p.is_file())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn kib_as_mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

struct Report {
    args: Args,
    timings: Timings,
    round_mem: BTreeMap<&'static str, Vec<Mem>>,
    shim_mem: Vec<(Runtime, MemRows)>,
    big_rss: Vec<(Runtime, u64)>,
    sizes: Vec<(Runtime, PathBuf, u64, Option<u64>)>,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn render(report: &Report) -> String {
    let root = repo_root();
    let git = |args: &[&str]| -> String {
        Cmd::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .map(|o| o.stdout.trim().to_owned())
            .unwrap_or_default()
    };
    let mut commit = git(&["rev-parse", "--short", "HEAD"]);
    if !git(&["status", "--porcelain", "--", "shim-v2"]).is_empty() {
        commit.push_str(" (shim-v2 with uncommitted changes)");
    }
    let date = first_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                Some(
                    l.strip_prefix("model name")?
                        .trim_start_matches([' ', '\t', ':'])
                        .to_owned(),
                )
            })
        })
        .unwrap_or_else(|| "?".into());
    let mem_total = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_owned())
        })
        .and_then(|kib| kib.parse::<u64>().ok())
        .map(|kib| format!("{:.0} GiB", kib as f64 / (1 << 20) as f64))
        .unwrap_or_else(|| "?".into());
    let command_line = std::env::args().skip(1).fold(
        "cargo run --release -p gpucr-tests --bin bench-checkpoint --".to_owned(),
        |acc, a| acc + " " + &a,
    );

    let mut s = String::new();
    let w = &mut s;
    let _ = writeln!(w, "### {date}: bench-checkpoint\n");
    let _ = writeln!(
        w,
        "- machine: {} CPUs ({cpu}), {mem_total} RAM, kernel {}, cgroup {}",
        first_line("nproc", &[]),
        first_line("uname", &["-r"]),
        cgroup_mode()
    );
    let _ = writeln!(
        w,
        "- versions: {}; {}; criu {}",
        first_line("containerd", &["--version"]),
        first_line("runc", &["--version"]),
        first_line("criu", &["--version"]).trim_start_matches("Version: ")
    );
    let _ = writeln!(w, "- commit: {commit}");
    let _ = writeln!(
        w,
        "- command: `GPUCR_SHIM_DIR=<target>/release {command_line}`{}",
        if net_host() {
            " (GPUCR_TEST_NET_HOST=1)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        w,
        "- one containerd, both runtimes; rounds interleaved (first runtime alternating); wall \
         time of each `ctr` command\n"
    );

    let _ = writeln!(
        w,
        "| operation | runc.v2 median (ms) | gpucr median (ms) | ratio gpucr/runc | runc.v2 p10–p90 | gpucr p10–p90 | rounds |"
    );
    let _ = writeln!(w, "|---|---:|---:|---:|---:|---:|---:|");
    for op in &report.timings.order {
        let r = report.timings.get(op, RUNC);
        let g = report.timings.get(op, GPUCR);
        let (rm, gm) = (quantile(r, 0.5), quantile(g, 0.5));
        let _ = writeln!(
            w,
            "| `{op}` | {rm:.0} | {gm:.0} | **{:.2}** | {:.0}–{:.0} | {:.0}–{:.0} | {} |",
            gm / rm,
            quantile(r, 0.1),
            quantile(r, 0.9),
            quantile(g, 0.1),
            quantile(g, 0.9),
            r.len().min(g.len())
        );
    }

    let _ = writeln!(
        w,
        "\nShim memory (`/proc/<pid>/smaps_rollup` of the shim processes, total divided by the \
         number of containers; threads: total over the shims):\n"
    );
    let _ = writeln!(
        w,
        "| shim | containers | shim processes | RSS per container | PSS per container | threads |"
    );
    let _ = writeln!(w, "|---|---|---:|---:|---:|---:|");
    for rt in RUNTIMES {
        if let Some(mems) = report.round_mem.get(rt.short) {
            let rss: Vec<f64> = mems.iter().map(|m| m.rss_kib as f64).collect();
            let pss: Vec<f64> = mems.iter().map(|m| m.pss_kib as f64).collect();
            let threads: Vec<f64> = mems.iter().map(|m| m.threads as f64).collect();
            let _ = writeln!(
                w,
                "| {} | 1, after restore + task checkpoint (median of {}) | 1 | {} | {} | {:.0} |",
                rt.name,
                mems.len(),
                kib_as_mib(quantile(&rss, 0.5) as u64),
                kib_as_mib(quantile(&pss, 0.5) as u64),
                quantile(&threads, 0.5)
            );
        }
    }
    for (rt, rows) in &report.shim_mem {
        for (what, m, shims) in rows {
            let _ = writeln!(
                w,
                "| {} | {what} | {shims} | {} | {} | {} |",
                rt.name,
                kib_as_mib(m.rss_kib),
                kib_as_mib(m.pss_kib),
                m.threads
            );
        }
    }

    let _ = writeln!(w, "\nShim binaries:\n");
    let _ = writeln!(w, "| shim | path | size | stripped |");
    let _ = writeln!(w, "|---|---|---:|---:|");
    for (rt, path, size, stripped) in &report.sizes {
        let _ = writeln!(
            w,
            "| {} | `{}` | {} | {} |",
            rt.name,
            path.display(),
            mib(*size),
            stripped.map(mib).unwrap_or_else(|| "?".into())
        );
    }
    if !report.big_rss.is_empty() {
        let _ = writeln!(
            w,
            "\nThe {} MiB rows: the container's shell holds a {} MiB string; after each restore \
             its RSS was checked ({}).",
            report.args.mem_mib,
            report.args.mem_mib,
            report
                .big_rss
                .iter()
                .map(|(rt, kib)| format!("{}: {}", rt.short, kib_as_mib(*kib)))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    let _ = writeln!(
        w,
        "\n<details><summary>samples (ms, in round order)</summary>\n"
    );
    for op in &report.timings.order {
        for rt in RUNTIMES {
            let samples: Vec<String> = report
                .timings
                .get(op, rt)
                .iter()
                .map(|v| format!("{v:.0}"))
                .collect();
            let _ = writeln!(w, "- `{op}` {}: {}", rt.short, samples.join(" "));
        }
    }
    let _ = writeln!(w, "\n</details>\n");
    s
}

const HEADER: &str = "# Benchmarks

Speed and size targets are checked by benchmarks that write dated, re-runnable results here,
measured side by side in one run (ratios: the machines are noisy), not by timed tests.

## bench-checkpoint (issue 2)

The same container checkpointed and restored through `io.containerd.runc.v2` and through gpucr
(`io.containerd.gpucr.v2`) in one private containerd, rounds interleaved, the runtime that goes
first alternating every round. Target: ratio gpucr/runc ≤ 1.05 for every operation, and a
smaller shim (RSS/PSS per container, binary size).

Per round and runtime: the busybox counter workload (`gpucr_tests::COUNTER_SCRIPT`) runs
detached (`ctr run -d`, timed) and counts a while; then the wall time of
`ctr container checkpoint --task --rw`, of `ctr container restore --live --rw` (after the task
and container are removed), and of `ctr task checkpoint` (the task keeps running; its image is
removed with `ctr image rm --sync`). Every restore must continue the counter from the
checkpointed value and every checkpoint image must hold a CRIU tar, or the run fails.
Shim memory is the RSS and PSS (`/proc/<pid>/smaps_rollup`) of the shim processes: after a
round's restore and task checkpoint, with one idle container, with N containers (one shim each)
and with N containers in one shim (grouped by the `io.kubernetes.cri.sandbox-id` annotation),
divided by the number of containers. The `N MiB` rows checkpoint and restore a container whose
shell holds N MiB of anonymous memory.

Re-run (as root, with containerd, runc and CRIU installed; see `.ci/run`):

```sh
export CARGO_TARGET_DIR=/work/target-bench   # any target dir
cargo build --release -p containerd-shim-gpucr-v2
GPUCR_SHIM_DIR=$CARGO_TARGET_DIR/release \\
  cargo run --release -p gpucr-tests --bin bench-checkpoint -- --rounds 10 --out docs/BENCHMARKS.md
```

Flags: `--rounds N` (10), `--containers N` (5), `--mem-mib N` (256; 0 skips),
`--mem-rounds N` (3), `--out FILE` (the section is also printed), `--containerd-log FILE`
(keeps containerd's log, with both shims' logs: the daemon runs at debug level, so gpucr logs
every runc call; `GPUCR_LOG` in the environment overrides gpucr's filter). One untimed warm-up
round per runtime precedes the timed ones.

## Results

";

/// Inserts `section` at the top of the results of `path` (created with [`HEADER`] if absent).
fn write_out(path: &Path, section: &str) -> BoxResult<()> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e.into()),
    };
    let marker = format!("{RESULTS_MARKER}\n\n");
    let new = match text.find(RESULTS_MARKER) {
        Some(at) => {
            let rest = text[at + RESULTS_MARKER.len()..].trim_start_matches('\n');
            format!("{}{marker}{section}{rest}", &text[..at])
        }
        None if text.is_empty() => format!("{HEADER}{marker}{section}"),
        None => format!("{}\n\n## Results\n\n{marker}{section}", text.trim_end()),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, new)?;
    Ok(())
}

fn bench(args: &Args, ctd: &Containerd, image: &str) -> BoxResult<Report> {
    let mut timings = Timings::default();
    let mut round_mem: BTreeMap<&'static str, Vec<Mem>> = BTreeMap::new();
    let order = |n: usize| [RUNTIMES, [GPUCR, RUNC]][n % 2];

    // One untimed round each, so that caches (page cache, CRIU, the image) are warm.
    for rt in RUNTIMES {
        eprintln!("warm-up round, {}", rt.short);
        round(ctd, image, rt, 999, &mut Timings::default())?;
    }
    for n in 0..args.rounds {
        for rt in order(n) {
            let mem = round(ctd, image, rt, n, &mut timings)?;
            round_mem.entry(rt.short).or_default().push(mem);
            eprintln!(
                "round {n} {}: {}",
                rt.short,
                timings
                    .order
                    .iter()
                    .map(|op| format!(
                        "{op}: {:.0} ms",
                        timings.get(op, rt).last().unwrap_or(&f64::NAN)
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }

    let mut big_rss = Vec::new();
    if args.mem_mib > 0 {
        for n in 0..args.mem_rounds {
            for rt in order(n) {
                let rss = memory_round(ctd, image, rt, n, args.mem_mib, &mut timings)?;
                eprintln!(
                    "memory round {n} {}: restored RSS {}",
                    rt.short,
                    kib_as_mib(rss)
                );
                if n == 0 {
                    big_rss.push((rt, rss));
                }
            }
        }
    }

    let mut shim_mem = Vec::new();
    for rt in RUNTIMES {
        eprintln!("shim memory, {}", rt.short);
        shim_mem.push((rt, shim_memory(ctd, image, rt, args.containers)?));
    }

    let mut sizes = Vec::new();
    let gpucr_path = shim_dir()?.join(shim_binary(GPUCR));
    let runc_path = find_in_path(shim_binary(RUNC)).ok_or("containerd-shim-runc-v2 not in PATH")?;
    for (rt, path) in [(RUNC, runc_path), (GPUCR, gpucr_path)] {
        let (size, stripped) = binary_sizes(&path)?;
        sizes.push((rt, path, size, stripped));
    }
    Ok(Report {
        args: args.clone(),
        timings,
        round_mem,
        shim_mem,
        big_rss,
        sizes,
    })
}

fn main() -> BoxResult<()> {
    let args = Args::parse()?;
    // Both runtimes run in the one daemon; the harness needs the gpucr shim either way.
    shim_dir()?;
    let ctd = Containerd::start()?;
    let image = ctd.import_busybox()?;
    let result = bench(&args, &ctd, &image);
    if let Some(path) = &args.containerd_log {
        fs::copy(ctd.dir().join("containerd.log"), path)?;
    }
    let report = match result {
        Ok(report) => report,
        Err(e) => {
            eprintln!("==== containerd log tail ====\n{}", ctd.log_tail(60));
            return Err(e);
        }
    };
    drop(ctd);
    let section = render(&report);
    println!("{section}");
    if let Some(path) = &args.out {
        write_out(path, &section)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
