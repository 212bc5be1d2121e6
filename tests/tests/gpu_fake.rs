//! The shim's GPU paths end to end on a CPU machine: a real containerd, runc and CRIU, with
//! tests/fake-libcuda as the CUDA driver.
//!
//! Every container process is a GPU candidate (`GPUCR_GPU_ALL_PROCESSES=1`); the fake's script
//! says which pids are CUDA processes and how each driver call behaves, and its log and state
//! file show what the shim (or CRIU's plugin) did to them. CRIU loads the installed plugin
//! (install.sh puts it in /usr/lib/criu) in every test: by default the shim quiesces and
//! the plugin leaves the shim's processes alone (each driver call happens exactly once);
//! `io.gpucr.gpu-quiesce=plugin` hands the GPU to the plugin.
//!
//! Only meaningful for gpucr: with `GPUCR_TEST_RUNTIME` set to another runtime they pass
//! without doing anything.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, UNIX_EPOCH};

use gpucr_tests::criu_wrapper::{CriuFault, CriuWrapper, MID_DUMP, MID_RESTORE};
use gpucr_tests::fake_cuda::{self, FakeCuda, CHECKPOINTED, FULL_CYCLE, LOCKED, RUNNING};
use gpucr_tests::leftovers::Failpoints;
use gpucr_tests::manifest::rewrite_with_manifest;
use gpucr_tests::shim_client::{CheckpointFlags, CheckpointOutcome};
use gpucr_tests::{
    counter_args, poll_until, procfs, runtime_under_test, unique_id, Containerd, GPUCR_RUNTIME,
};
use serde_json::Value;

/// Counter value the workload reaches before a checkpoint.
const WARM_COUNT: u64 = 5;

/// A daemon whose shims use a fake libcuda. Fields drop in order: the daemon (and its shims)
/// before the fake's files.
struct Gpu {
    ctd: Containerd,
    image: String,
    fake: FakeCuda,
}

/// `ctr run` flags that hand the container's GPU to CRIU's plugin.
const PLUGIN_QUIESCES: [&str; 2] = ["--annotation", "io.gpucr.gpu-quiesce=plugin"];

fn gpucr_under_test() -> bool {
    let runtime = runtime_under_test();
    if runtime != GPUCR_RUNTIME {
        eprintln!("skipped: GPU paths are gpucr's, the runtime under test is {runtime}");
        return false;
    }
    true
}

fn start() -> Option<Gpu> {
    start_with_env(Vec::new())
}

/// [`start`] with more environment for the daemon (and so its shims, runc and CRIU).
fn start_with_env(extra: Vec<(String, String)>) -> Option<Gpu> {
    if !gpucr_under_test() {
        return None;
    }
    let fake = FakeCuda::new().expect("fake libcuda");
    let mut env = fake.env();
    env.extend(extra);
    let ctd = Containerd::start_with_env(&env).expect("containerd");
    let image = ctd.import_busybox().expect("busybox image");
    Some(Gpu { ctd, image, fake })
}

impl Gpu {
    /// Pids the fake driver was called for, other than `pid` (a restored tree's new pids).
    fn pids_other_than(&self, pid: u32) -> Vec<u32> {
        self.fake
            .called_pids()
            .into_iter()
            .filter(|p| *p != pid)
            .collect()
    }

    /// A checkpoint with `exit` (into `image_path` when given); returns once the task stopped.
    fn checkpoint_exit(&self, id: &str, image_path: Option<&Path>) -> CheckpointOutcome {
        let flags = CheckpointFlags {
            exit: true,
            image_path,
            ..Default::default()
        };
        let outcome = self
            .ctd
            .checkpoint_with_flags(id, &flags)
            .expect("checkpoint --exit");
        self.ctd.wait_status(id, "STOPPED").unwrap();
        outcome
    }

    /// Runs the counter (with extra `ctr run` flags) and waits until it has counted a bit;
    /// returns the task's init pid.
    fn counter(&self, id: &str, flags: &[&str]) -> u32 {
        self.ctd
            .run_detached_with(id, &self.image, flags, &counter_args())
            .expect("ctr run");
        self.ctd.wait_status(id, "RUNNING").unwrap();
        self.ctd.wait_counter_above(id, WARM_COUNT).unwrap();
        self.ctd.task_pid(id).unwrap()
    }

    /// Declares `pids` CUDA processes, followed by `rules`.
    fn script(&self, pids: &[u32], rules: &str) {
        let mut s: String = pids.iter().map(|p| format!("cuda {p}\n")).collect();
        s.push_str(rules);
        self.fake.set_script(&s).unwrap();
    }

    /// After a failed checkpoint: the task runs (not paused), counts on, and the fake driver
    /// has every process RUNNING.
    fn assert_recovered(&self, id: &str, pids: &[u32]) {
        assert_eq!(
            self.ctd.task_status(id).unwrap().as_deref(),
            Some("RUNNING"),
            "task {id} after the failed checkpoint"
        );
        let now = self.ctd.read_counter(id).unwrap();
        self.ctd
            .wait_counter_above(id, now)
            .expect("the workload counts on after the failed checkpoint");
        let states = self.fake.states();
        for pid in pids {
            assert_eq!(
                states.get(pid).copied().unwrap_or(RUNNING),
                RUNNING,
                "fake driver state of {pid}: {states:?}; calls {:#?}",
                self.fake.calls()
            );
        }
    }

    /// A checkpoint that must fail; returns its error text.
    fn failed_checkpoint(&self, id: &str) -> String {
        let started = Instant::now();
        match self.ctd.task_checkpoint(id, &[]) {
            Ok(image) => panic!(
                "checkpoint of {id} succeeded ({image:?}); fake calls {:#?}",
                self.fake.calls()
            ),
            Err(e) => {
                eprintln!("checkpoint failed after {:?}: {e}", started.elapsed());
                e.to_string()
            }
        }
    }

    /// `exec -d` of `sleep <n>` in the container; returns its host pid.
    fn exec_sleeper(&self, id: &str, n: u32) -> u32 {
        let arg = n.to_string();
        self.ctd
            .ctr_ok(&[
                "task",
                "exec",
                "-d",
                "--exec-id",
                "sleeper",
                id,
                "sleep",
                &arg,
            ])
            .expect("exec sleeper");
        poll_until("sleeper pid", Duration::from_secs(10), || {
            Ok(procfs::processes()
                .into_iter()
                .find(|p| p.argv == ["sleep", arg.as_str()])
                .map(|p| p.pid as u32)
                .ok_or(()))
        })
        .unwrap()
    }

    /// Each process restored in place of the checkpointed `pid` (the task's init among them)
    /// had its GPU restored and unlocked exactly once, and runs.
    fn assert_restored_once(&self, id: &str, pid: u32) {
        let new_pid = self.ctd.task_pid(id).unwrap();
        let restored = self.pids_other_than(pid);
        assert!(restored.contains(&new_pid), "{:#?}", self.fake.log());
        for p in &restored {
            assert_eq!(
                self.fake.calls_of(*p),
                ["restore -> 0", "unlock -> 0"],
                "pid {p}"
            );
            assert_eq!(self.fake.states().get(p), Some(&RUNNING), "pid {p}");
        }
    }

    /// The restored workload continues from the checkpoint and keeps counting.
    fn assert_continues(&self, id: &str, before: u64, after: u64, restored_at: Instant) {
        self.ctd
            .wait_status(id, "RUNNING")
            .expect("restored task runs");
        let first = self.ctd.wait_counter_above(id, 0).unwrap();
        let slack = restored_at.elapsed().as_millis() as u64 / 150 + 3;
        assert!(
            first >= before && first <= after + slack,
            "restored counter of {id} is {first}; checkpointed between {before} and {after}"
        );
        self.ctd.wait_counter_above(id, first).unwrap();
    }
}

fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// The (start, end) of the fake's call `line`.
fn call_time(fake: &FakeCuda, line: &str) -> (u64, u64) {
    fake.timed_calls()
        .into_iter()
        .find(|(_, _, l)| l == line)
        .map(|(s, e, _)| (s, e))
        .unwrap_or_else(|| panic!("no call {line:?} in {:#?}", fake.timed_calls()))
}

#[test]
fn leave_running_checkpoint_quiesces_around_the_dump() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-run");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");

    let stored = g
        .ctd
        .task_checkpoint(&id, &[])
        .expect("ctr task checkpoint")
        .expect("checkpoint image stored");
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "{:#?}", g.fake.log());
    assert_eq!(
        g.fake.called_pids(),
        vec![pid],
        "only the CUDA pid is touched"
    );
    assert_eq!(g.fake.states().get(&pid), Some(&RUNNING));
    // The installed CUDA plugin was loaded by the same CRIU and left the pid to the shim.
    let dump = criu_log(&g.ctd, &id, "dump.log");
    assert!(
        dump.contains(&format!(
            "CUDA process {pid} was quiesced by the gpucr shim"
        )),
        "the plugin recognised the shim's process: {dump}"
    );

    // Lock and checkpoint end before CRIU starts (dump.log is created), restore starts after
    // it finished (dump.log's last write). File times come from the coarse clock (up to a
    // few ms behind), hence the slack.
    let dump_log = g.ctd.bundle(&id).join("criu-work/dump.log");
    let md = std::fs::metadata(&dump_log).expect("CRIU's dump.log is kept");
    let (dump_start, dump_end) = (
        unix_ms(md.created().unwrap()),
        unix_ms(md.modified().unwrap()),
    );
    let (_, checkpointed) = call_time(&g.fake, &format!("checkpoint {pid} -> 0"));
    let (restore_start, _) = call_time(&g.fake, &format!("restore {pid} -> 0"));
    assert!(
        checkpointed <= dump_start + 10,
        "GPU checkpoint ended at {checkpointed}, CRIU started at {dump_start}"
    );
    assert!(
        restore_start + 10 >= dump_end,
        "GPU restore started at {restore_start}, CRIU ended at {dump_end}"
    );

    g.ctd.wait_status(&id, "RUNNING").unwrap();
    let after = g.ctd.read_counter(&id).unwrap();
    g.ctd.wait_counter_above(&id, after).unwrap();

    let files = g.ctd.checkpoint_files(&stored).unwrap();
    let record: Value = serde_json::from_slice(
        files
            .get("gpucr-gpu.json")
            .unwrap_or_else(|| panic!("no gpucr-gpu.json in {:?}", files.keys())),
    )
    .unwrap();
    let pids: Vec<u64> = record["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["pid"].as_u64())
        .collect();
    assert_eq!(pids, vec![u64::from(pid)], "{record}");
    let manifest: Value = serde_json::from_slice(
        files
            .get("gpucr-checkpoint.json")
            .unwrap_or_else(|| panic!("no gpucr-checkpoint.json in {:?}", files.keys())),
    )
    .unwrap();
    assert!(
        manifest["files"].get("gpucr-gpu.json").is_some(),
        "the manifest covers the GPU record: {manifest}"
    );
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn restore_resumes_the_restored_cuda_processes() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-restore");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    let spec = g.ctd.container_spec(&id).unwrap();
    let before = g.ctd.read_counter(&id).unwrap();
    let checkpoint = g.checkpoint_exit(&id, None);
    assert_eq!(g.fake.calls_of(pid), ["lock -> 0", "checkpoint -> 0"]);
    assert_eq!(g.fake.states().get(&pid), Some(&CHECKPOINTED));

    // The restored tree has new pids, which the driver knows CHECKPOINTED.
    g.fake.set_script("cuda * state=checkpointed\n").unwrap();
    g.ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    g.ctd
        .restore_outcome(&id, &checkpoint, &g.image, &spec)
        .expect("restore");
    let new_pid = g.ctd.task_pid(&id).unwrap();
    let restored = g.pids_other_than(pid);
    assert!(
        restored.contains(&new_pid),
        "restored init {new_pid} was not resumed: {:#?}",
        g.fake.log()
    );
    for p in &restored {
        assert_eq!(
            g.fake.calls_of(*p),
            ["restore -> 0", "unlock -> 0"],
            "pid {p}"
        );
        assert_eq!(g.fake.states().get(p), Some(&RUNNING), "pid {p}");
    }
    g.assert_continues(&id, before, before + 2, restored_at);
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn failed_gpu_restore_leaves_nothing_behind() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-restorefail");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    let spec = g.ctd.container_spec(&id).unwrap();
    let before = g.ctd.read_counter(&id).unwrap();
    let dir = g.ctd.dir().join("restorefail-images");
    g.checkpoint_exit(&id, Some(&dir));
    g.ctd.remove_container(&id).unwrap();

    // CRIU restores the tree, then the driver refuses to give the device memory back.
    g.fake
        .set_script("cuda * state=checkpointed\nrestore * fail 2\n")
        .unwrap();
    let err = g
        .ctd
        .restore_from_image_path(&id, &dir, &g.image, &spec)
        .expect_err("restore whose GPU restore fails")
        .to_string();
    assert!(
        err.contains("restore of device memory"),
        "the error names the step: {err}"
    );
    // The restore failed in Start: containerd keeps the task CREATED (nothing runs) until its
    // client deletes it, as with runc's shim.
    let victims: Vec<u32> = g
        .fake
        .called_pids()
        .into_iter()
        .filter(|p| *p != pid)
        .collect();
    assert!(!victims.is_empty(), "{:#?}", g.fake.log());
    for p in &victims {
        procfs::wait_gone(
            "half-restored process dies",
            *p as i32,
            Duration::from_secs(5),
        )
        .unwrap();
    }
    assert_ne!(g.ctd.task_status(&id).unwrap().as_deref(), Some("RUNNING"));
    assert!(!runc_knows(&g.ctd, &id), "runc still knows {id}");
    let _ = g.ctd.ctr(&["task", "rm", "-f", &id]);
    assert_nothing_left(&g.ctd, &id);

    // The same image restores once the driver cooperates.
    g.fake.set_script("cuda * state=checkpointed\n").unwrap();
    let restored_at = Instant::now();
    g.ctd
        .restore_from_image_path(&id, &dir, &g.image, &spec)
        .expect("restore");
    g.assert_continues(&id, before, before + 2, restored_at);
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn checkpoint_of_a_paused_task_quiesces_and_stays_paused() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-paused");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    g.ctd.ctr_ok(&["task", "pause", &id]).unwrap();
    g.ctd.wait_status(&id, "PAUSED").unwrap();
    g.ctd
        .task_checkpoint(&id, &[])
        .expect("checkpoint of a paused task")
        .expect("checkpoint image stored");
    // Device memory is back, but the processes stay LOCKED while the task is paused: nothing
    // may run between the dump and the client's snapshot of the rootfs.
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE[..3], "{:#?}", g.fake.log());
    assert_eq!(g.fake.states().get(&pid), Some(&LOCKED));
    assert_eq!(
        g.ctd.task_status(&id).unwrap().as_deref(),
        Some("PAUSED"),
        "a paused task stays paused"
    );
    g.ctd.ctr_ok(&["task", "resume", &id]).unwrap();
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "unlocked on resume");
    assert_eq!(g.fake.states().get(&pid), Some(&RUNNING));
    let now = g.ctd.read_counter(&id).unwrap();
    g.ctd.wait_counter_above(&id, now).unwrap();
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn lock_failure_fails_the_checkpoint_and_the_task_runs_on() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-lockfail");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], &format!("lock {pid} fail 2\n"));
    let err = g.failed_checkpoint(&id);
    assert!(err.contains("lock"), "the error names the step: {err}");
    assert_eq!(g.fake.calls_of(pid), ["lock -> 2"]);
    g.assert_recovered(&id, &[pid]);
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn lock_timeout_from_the_annotation_fails_the_checkpoint() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-locktimeout");
    let pid = g.counter(&id, &["--annotation", "io.gpucr.gpu-lock-timeout-ms=1000"]);
    // The lock would take 20 s; the driver gives up after the annotation's 1 s.
    g.script(&[pid], &format!("lock {pid} hang 20000\n"));
    let started = Instant::now();
    let err = g.failed_checkpoint(&id);
    let took = started.elapsed();
    assert!(err.contains("lock"), "the error names the step: {err}");
    assert!(
        took < Duration::from_secs(8),
        "the 1 s lock timeout was not applied: the checkpoint took {took:?}"
    );
    assert_eq!(g.fake.calls_of(pid), ["lock -> 600"]);
    g.assert_recovered(&id, &[pid]);
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn checkpoint_failure_of_one_process_rolls_both_back() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-ckptfail");
    let pid = g.counter(&id, &[]);
    let sleeper = g.exec_sleeper(&id, 86_401);
    g.script(&[pid, sleeper], &format!("checkpoint {sleeper} fail 999\n"));
    let err = g.failed_checkpoint(&id);
    assert!(
        err.contains("checkpoint: "),
        "the error names the step: {err}"
    );
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "{:#?}", g.fake.log());
    assert_eq!(
        g.fake.calls_of(sleeper),
        ["lock -> 0", "checkpoint -> 999", "unlock -> 0"]
    );
    g.assert_recovered(&id, &[pid, sleeper]);
    assert!(
        procfs::is_alive(sleeper as i32),
        "the second process runs on"
    );
    g.ctd.remove_container(&id).unwrap();
}

/// A tiny tmpfs (two pages) at a fresh directory under the daemon's, unmounted on drop: room
/// for runc's descriptors.json, not for CRIU's images.
struct TinyTmpfs(PathBuf);

impl TinyTmpfs {
    fn new(path: PathBuf) -> TinyTmpfs {
        std::fs::create_dir_all(&path).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=8k", "gpucr-tiny"])
            .arg(&path)
            .status()
            .unwrap();
        assert!(st.success(), "mounting a tmpfs on {}", path.display());
        TinyTmpfs(path)
    }
}

impl Drop for TinyTmpfs {
    fn drop(&mut self) {
        procfs::unmount_under(&self.0);
    }
}

#[test]
fn failed_dump_after_gpu_checkpoint_resumes_the_gpu() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-dumpfail");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    // CRIU runs out of space for its images: the dump fails after the shim locked and
    // checkpointed the GPU.
    let images = TinyTmpfs::new(g.ctd.dir().join("tiny-images"));
    let work = g.ctd.dir().join("dump-work");
    let flags = CheckpointFlags {
        image_path: Some(&images.0),
        work_path: Some(&work),
        ..Default::default()
    };
    let err = match g.ctd.checkpoint_with_flags(&id, &flags) {
        Ok(o) => panic!("a dump into a read-only directory succeeded: {o:?}"),
        Err(e) => e.to_string(),
    };
    eprintln!("{err}");
    // The tiny tmpfs fills up: the error names the cause (criu_log.rs), not just the step.
    assert!(
        err.contains("disk is full") || err.contains("runc checkpoint"),
        "the error names the cause: {err}"
    );
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "{:#?}", g.fake.log());
    g.assert_recovered(&id, &[pid]);
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn failed_manifest_after_the_dump_resumes_the_gpu() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-manifest");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    // The dump and the GPU record succeed; the manifest cannot be written (a directory holds
    // its name). The task lives on (leave-running), so its GPU must too.
    let images = g.ctd.dir().join("manifest-images");
    std::fs::create_dir_all(images.join("gpucr-checkpoint.json")).unwrap();
    let flags = CheckpointFlags {
        image_path: Some(&images),
        ..Default::default()
    };
    let err = match g.ctd.checkpoint_with_flags(&id, &flags) {
        Ok(o) => panic!("a checkpoint without its manifest succeeded: {o:?}"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("gpucr-checkpoint.json"),
        "the error names the manifest: {err}"
    );
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "{:#?}", g.fake.log());
    g.assert_recovered(&id, &[pid]);
    g.ctd.remove_container(&id).unwrap();
}

/// `runc checkpoint` SIGKILLed while CRIU dumps pages, after the shim locked and
/// checkpointed the GPU: the shim kills CRIU with runc's process group and gives the GPU
/// back (the full cycle, every process RUNNING), and the task runs on.
#[test]
fn runc_killed_mid_dump_gives_the_gpu_back() {
    let criu = CriuWrapper::install();
    let Some(g) = start_with_env(criu_path(&criu)) else {
        return;
    };
    let id = unique_id("gpu-runckill");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    criu.arm(CriuFault::KillRuncAt(MID_DUMP));
    let err = g.failed_checkpoint(&id);
    criu.disarm();
    assert!(
        err.contains("runc checkpoint"),
        "the error names runc: {err}"
    );
    criu.assert_gone("criu-of-killed-runc.pids", Duration::from_secs(5));
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "{:#?}", g.fake.log());
    g.assert_recovered(&id, &[pid]);
    g.ctd.remove_container(&id).unwrap();
}

/// The environment that puts the wrapper first in the daemon's PATH.
fn criu_path(criu: &CriuWrapper) -> Vec<(String, String)> {
    vec![(
        "PATH".into(),
        criu.path_env().to_string_lossy().into_owned(),
    )]
}

/// containerd restarted while the shim holds a leave-running checkpoint at
/// `checkpoint.before-dump` (the GPU locked and checkpointed, the task frozen): the shim
/// finishes the checkpoint on its own, the GPU ends unlocked (its full cycle, once), the task
/// is reported as it is (paused when ctr paused it and lost its daemon before its resume;
/// the GPU stays locked until the resume, as for any paused task), and every verb works
/// after: checkpoint again, kill, delete.
#[test]
fn containerd_restarted_mid_checkpoint_gives_the_gpu_back() {
    let points = Failpoints::new();
    let dir = points.path().to_string_lossy().into_owned();
    let Some(mut g) = start_with_env(vec![("GPUCR_FAILPOINTS".into(), dir)]) else {
        return;
    };
    let id = unique_id("gpu-ctdck");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    let point = "checkpoint.before-dump";
    points.pause(point);
    let ck = g.ctd.ctr_in_background(&["task", "checkpoint", &id]);
    points.wait_held(point);
    assert_eq!(
        g.fake.calls_of(pid),
        ["lock -> 0", "checkpoint -> 0"],
        "held with the GPU locked"
    );
    g.ctd.restart().unwrap();
    points.release(point);
    let _ = ck.join().unwrap().expect("ctr ran");
    let status = poll_until("the task settles", Duration::from_secs(30), || {
        Ok(match g.ctd.task_status(&id)? {
            Some(s) if s == "RUNNING" || s == "PAUSED" => Ok(s),
            other => Err(other),
        })
    })
    .unwrap();
    if status == "PAUSED" {
        assert_eq!(g.fake.states().get(&pid), Some(&LOCKED), "paused: locked");
        g.ctd.ctr_ok(&["task", "resume", &id]).unwrap();
    }
    // Finished (the dump ran) or undone, the GPU went through its cycle once and runs.
    poll_until("the GPU given back", Duration::from_secs(30), || {
        let calls = g.fake.calls_of(pid);
        Ok(if calls == FULL_CYCLE {
            Ok(())
        } else {
            Err(calls)
        })
    })
    .unwrap();
    g.assert_recovered(&id, &[pid]);

    g.ctd
        .task_checkpoint(&id, &[])
        .expect("checkpoint again")
        .expect("checkpoint image stored");
    assert_eq!(
        g.fake.calls_of(pid),
        [FULL_CYCLE, FULL_CYCLE].concat(),
        "{:#?}",
        g.fake.log()
    );
    g.assert_recovered(&id, &[pid]);
    g.ctd
        .ctr_ok(&["task", "kill", "-s", "SIGKILL", &id])
        .unwrap();
    g.ctd.wait_status(&id, "STOPPED").unwrap();
    g.ctd.ctr_ok(&["task", "rm", &id]).unwrap();
    g.ctd.ctr_ok(&["container", "rm", &id]).unwrap();
    g.ctd.assert_nothing_left(&id);
}

/// A GPU checkpoint whose `runc restore` is SIGKILLed once CRIU forks the restored tree: the
/// restore fails naming runc, CRIU is gone, the driver was never called for the
/// half-restored processes, nothing is left (processes, runc state, mounts, containerd's
/// unpacked copy), and the checkpoint restores after with each restored process's GPU
/// restored and unlocked exactly once.
#[test]
fn runc_killed_mid_restore_leaves_nothing_and_the_gpu_checkpoint_restores() {
    let criu = CriuWrapper::install();
    let Some(g) = start_with_env(criu_path(&criu)) else {
        return;
    };
    let id = unique_id("gpu-runcrs");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    let reference = format!("docker.io/gpucr/gpu-runcrs:{id}");
    let before = g.ctd.read_counter(&id).unwrap();
    g.ctd.container_checkpoint(&id, &reference, true).unwrap();
    let after = g.ctd.read_counter(&id).unwrap();
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "{:#?}", g.fake.log());
    g.ctd.remove_container(&id).unwrap();

    // The restored tree has new pids, which the driver knows CHECKPOINTED.
    g.fake.set_script("cuda * state=checkpointed\n").unwrap();
    criu.arm(CriuFault::KillRuncAt(MID_RESTORE));
    let out = g
        .ctd
        .ctr(&["container", "restore", "--live", "--rw", &id, &reference])
        .unwrap();
    criu.disarm();
    assert!(!out.success(), "the restore must fail: {}", out.stdout);
    assert!(
        !criu.pids("killed-runc.pids").is_empty(),
        "runc was not killed"
    );
    assert!(out.stderr.contains("runc restore"), "{}", out.stderr);
    criu.assert_gone("criu-of-killed-runc.pids", Duration::from_secs(5));
    assert_eq!(
        g.pids_other_than(pid),
        Vec::<u32>::new(),
        "the driver was called for a half-restored tree: {:#?}",
        g.fake.log()
    );
    g.ctd.remove_with_force(&id);

    let restored_at = Instant::now();
    g.ctd.container_restore(&id, &reference, true).unwrap();
    g.assert_restored_once(&id, pid);
    g.assert_continues(&id, before, after, restored_at);
    g.ctd.remove_container(&id).unwrap();
    g.ctd.assert_nothing_left(&id);
}

/// True while runc has state for container `id` (the shim's default runc root).
fn runc_knows(ctd: &Containerd, id: &str) -> bool {
    Path::new("/run/containerd/runc")
        .join(ctd.namespace())
        .join(id)
        .exists()
}

/// A refused restore left no task, no shim and no runc container behind.
fn assert_nothing_left(ctd: &Containerd, id: &str) {
    assert_eq!(ctd.task_status(id).unwrap(), None, "no task {id}");
    let address = ctd.address().to_string_lossy().into_owned();
    poll_until("shim exits", Duration::from_secs(10), || {
        Ok(match procfs::shim_pid(&address, id) {
            None => Ok(()),
            Some(p) => Err(p),
        })
    })
    .unwrap();
    assert!(!runc_knows(ctd, id), "runc still knows {id}");
    ctd.wait_unpacked_removed()
        .expect("containerd's unpacked copy of a refused checkpoint is removed");
    // ctr created the container record before the task; drop it for the next attempt.
    let _ = ctd.ctr(&["container", "rm", id]);
}

#[test]
fn restore_is_refused_for_other_gpus_and_damaged_images() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-refuse");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    let spec = g.ctd.container_spec(&id).unwrap();
    let before = g.ctd.read_counter(&id).unwrap();
    let dir = g.ctd.dir().join("refuse-images");
    g.checkpoint_exit(&id, Some(&dir));
    g.ctd.remove_container(&id).unwrap();

    // The checkpoint "ran" on an H200; this host has no NVIDIA GPU.
    let record_bytes = std::fs::read(dir.join("gpucr-gpu.json")).unwrap();
    let mut record: Value = serde_json::from_slice(&record_bytes).unwrap();
    record["inventory"] = serde_json::json!({
        "driver_version": "580.65.06",
        "source": "nvml",
        "gpus": [{
            "index": 0,
            "model": "NVIDIA H200",
            "uuid": "GPU-00000000-1111-2222-3333-444444444444",
            "bus_id": null,
            "memory_total_bytes": null,
            "memory_free_bytes": null
        }]
    });
    rewrite_with_manifest(
        &dir,
        "gpucr-gpu.json",
        &serde_json::to_vec(&record).unwrap(),
    );
    let err = g
        .ctd
        .restore_from_image_path(&id, &dir, &g.image, &spec)
        .expect_err("restore onto a host without the recorded GPU");
    let err = err.to_string();
    assert!(
        err.contains("cannot restore the GPU checkpoint") && err.contains("no NVIDIA GPU"),
        "the refusal names the difference: {err}"
    );
    assert_nothing_left(&g.ctd, &id);
    rewrite_with_manifest(&dir, "gpucr-gpu.json", &record_bytes);

    // A truncated memory image.
    let pages = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("pages-")
        })
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("a pages image");
    let pages_bytes = std::fs::read(&pages).unwrap();
    std::fs::write(&pages, &pages_bytes[..pages_bytes.len() / 2]).unwrap();
    let err = g
        .ctd
        .restore_from_image_path(&id, &dir, &g.image, &spec)
        .expect_err("restore of a truncated image");
    let err = err.to_string();
    let name = pages.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        err.contains(&name) && err.contains("truncated"),
        "the refusal names the damage: {err}"
    );
    assert_nothing_left(&g.ctd, &id);

    // Nothing was left half-created: the intact image restores under the same id, and its
    // restored processes are CUDA processes waiting CHECKPOINTED, as with a real driver.
    std::fs::write(&pages, &pages_bytes).unwrap();
    g.fake.set_script("cuda * state=checkpointed\n").unwrap();
    let restored_at = Instant::now();
    g.ctd
        .restore_from_image_path(&id, &dir, &g.image, &spec)
        .expect("restore of the intact image");
    g.assert_continues(&id, before, before + 2, restored_at);
    g.ctd.remove_container(&id).unwrap();
}

/// CRIU's log of the task's last checkpoint or restore, in its bundle.
fn criu_log(ctd: &Containerd, id: &str, name: &str) -> String {
    std::fs::read_to_string(ctd.bundle(id).join("criu-work").join(name)).unwrap_or_default()
}

#[test]
fn criu_plugin_quiesces_and_the_shim_does_not() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("gpu-plugin");
    let pid = g.counter(&id, &PLUGIN_QUIESCES);
    g.script(&[pid], "");
    let spec = g.ctd.container_spec(&id).unwrap();

    // Leave running: CRIU's plugin locks and checkpoints in the dump, and puts the process
    // back at its end; each call exactly once (the shim stays out).
    g.ctd
        .task_checkpoint(&id, &[])
        .expect("ctr task checkpoint")
        .expect("checkpoint image stored");
    assert_eq!(g.fake.calls_of(pid), FULL_CYCLE, "{:#?}", g.fake.log());
    let dump = criu_log(&g.ctd, &id, "dump.log");
    assert!(
        dump.contains(&format!("locking CUDA process {pid}")),
        "the plugin locked {pid} inside CRIU: {dump}"
    );
    g.ctd.wait_status(&id, "RUNNING").unwrap();
    let before = g.ctd.read_counter(&id).unwrap();
    g.ctd.wait_counter_above(&id, before).unwrap();

    // Exit, then restore: the plugin resumes the new pids, once each.
    let before = g.ctd.read_counter(&id).unwrap();
    let checkpoint = g.checkpoint_exit(&id, None);
    let mut cycle_then_dump = FULL_CYCLE.to_vec();
    cycle_then_dump.extend(["lock -> 0", "checkpoint -> 0"]);
    assert_eq!(g.fake.calls_of(pid), cycle_then_dump, "{:#?}", g.fake.log());

    g.fake.set_script("cuda * state=checkpointed\n").unwrap();
    g.ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    g.ctd
        .restore_outcome(&id, &checkpoint, &g.image, &spec)
        .expect("restore");
    let new_pid = g.ctd.task_pid(&id).unwrap();
    let restored = g.pids_other_than(pid);
    assert!(restored.contains(&new_pid), "{:#?}", g.fake.log());
    for p in &restored {
        assert_eq!(
            g.fake.calls_of(*p),
            ["restore -> 0", "unlock -> 0"],
            "pid {p}"
        );
        assert_eq!(g.fake.states().get(p), Some(&RUNNING), "pid {p}");
    }
    let restore = criu_log(&g.ctd, &id, "restore.log");
    assert!(
        restore.contains(&format!("resuming CUDA process {new_pid}")),
        "the plugin resumed {new_pid} inside CRIU: {restore}"
    );
    g.assert_continues(&id, before, before + 2, restored_at);
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn criu_plugin_without_a_driver_changes_nothing() {
    if !gpucr_under_test() {
        return;
    }
    let env = [("GPUCR_LIBCUDA", "/nonexistent/libcuda.so.1")];
    let ctd = Containerd::start_with_env(&env).expect("containerd");
    let image = ctd.import_busybox().unwrap();
    let id = unique_id("cpu-plugin");
    ctd.run_counter(&id, &image).unwrap();
    let before = ctd.wait_counter_above(&id, WARM_COUNT).unwrap();
    let checkpoint = ctd
        .task_checkpoint(&id, &[])
        .expect("checkpoint with the plugin loaded")
        .expect("checkpoint image stored");
    let dump = criu_log(&ctd, &id, "dump.log");
    assert!(
        dump.contains("Plugin \"cuda_plugin\"") && dump.contains("no CUDA driver: inactive"),
        "CRIU loaded the plugin, which found no driver: {dump}"
    );
    ctd.wait_status(&id, "RUNNING").unwrap();
    let after = ctd.read_counter(&id).unwrap();
    ctd.wait_counter_above(&id, after).unwrap();

    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.restore_task_checkpoint(&id, &checkpoint, true)
        .expect("restore with the plugin loaded");
    let restore = criu_log(&ctd, &id, "restore.log");
    assert!(
        restore.contains("Plugin \"cuda_plugin\""),
        "CRIU loaded the plugin for the restore: {restore}"
    );
    ctd.wait_status(&id, "RUNNING").unwrap();
    let first = ctd.wait_counter_above(&id, 0).unwrap();
    let slack = restored_at.elapsed().as_millis() as u64 / 150 + 3;
    assert!(
        first >= before && first <= after + slack,
        "restored counter {first}; checkpointed between {before} and {after}"
    );
    ctd.wait_counter_above(&id, first).unwrap();
    ctd.remove_container(&id).unwrap();
}

/// NVIDIA's `cuda_plugin.so` installed beside gpucr's (tests/criu-standin: its behaviour
/// where `cuda-checkpoint` is not on PATH, as on every node without NVIDIA's separate
/// binary): CRIU loads both, the shim quiesces, gpucr's plugin leaves the shim's process
/// to it, NVIDIA's is asked and declines, and every driver call happens once.
#[test]
fn nvidias_plugin_beside_gpucrs_leaves_the_gpu_to_the_shim() {
    if !gpucr_under_test() {
        return;
    }
    let plugins = tempfile::Builder::new()
        .prefix("gpucr-criu-libs-")
        .tempdir()
        .unwrap();
    // gpucr's installed plugin itself (a link), and the stand-in under NVIDIA's file name.
    std::os::unix::fs::symlink(
        fake_cuda::criu_plugin().expect("installed CRIU plugin"),
        plugins.path().join("gpucr_cuda_plugin.so"),
    )
    .unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("criu-standin/cuda_plugin.c");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(plugins.path().join("cuda_plugin.so"))
        .arg(&src)
        .status()
        .expect("cc");
    assert!(built.success(), "building {}", src.display());
    let standin_log = plugins.path().join("standin.log");
    let g = start_with_env(vec![
        (
            "CRIU_LIBS_DIR".into(),
            plugins.path().to_string_lossy().into_owned(),
        ),
        (
            "GPUCR_STANDIN_LOG".into(),
            standin_log.to_string_lossy().into_owned(),
        ),
    ])
    .expect("gpucr under test");

    let id = unique_id("gpu-nvplugin");
    let pid = g.counter(&id, &[]);
    g.script(&[pid], "");
    let spec = g.ctd.container_spec(&id).unwrap();
    let before = g.ctd.read_counter(&id).unwrap();
    let checkpoint = g.checkpoint_exit(&id, None);
    assert_eq!(
        g.fake.calls_of(pid),
        ["lock -> 0", "checkpoint -> 0"],
        "the shim quiesced, once: {:#?}",
        g.fake.log()
    );
    let asked = std::fs::read_to_string(&standin_log).unwrap_or_default();
    assert!(
        asked.contains("init 0 disabled") && asked.contains(&format!("pause_devices {pid}")),
        "CRIU loaded NVIDIA's stand-in, which was asked about {pid} and declined: {asked}"
    );

    g.fake.set_script("cuda * state=checkpointed\n").unwrap();
    g.ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    g.ctd
        .restore_outcome(&id, &checkpoint, &g.image, &spec)
        .expect("restore with both plugins installed");
    for p in g.pids_other_than(pid) {
        assert_eq!(
            g.fake.calls_of(p),
            ["restore -> 0", "unlock -> 0"],
            "pid {p}"
        );
    }
    let asked = std::fs::read_to_string(&standin_log).unwrap_or_default();
    assert!(asked.contains("init 2 disabled"), "{asked}");
    g.assert_continues(&id, before, before + 2, restored_at);
    g.ctd.remove_container(&id).unwrap();
    drop(g);
    drop(plugins);
}
