//! No verb can hang the shim: CRIU that never returns is killed at the step's deadline,
//! the task is left as it was, and State, Pids and Kill answer meanwhile.
//!
//! CRIU is made to hang by a `criu` wrapper first in containerd's PATH (runc runs `criu`
//! from PATH): while this test's `hang` file exists it sleeps instead of running the
//! installed CRIU, and otherwise it runs that CRIU.

use std::path::Path;
use std::time::{Duration, Instant};

use gpucr_tests::criu_wrapper::{CriuFault, CriuWrapper};
use gpucr_tests::{counter_args, runtime_under_test, unique_id, Containerd, GPUCR_RUNTIME};

/// The annotated deadline of these tests, in seconds.
const DEADLINE_S: u64 = 3;
/// How long a query may take while CRIU hangs (it answers from the recorded state).
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// A daemon whose runc finds the hanging wrapper. Drops the daemon before the wrapper.
struct Hanging {
    ctd: Containerd,
    image: String,
    criu: CriuWrapper,
}

impl Hanging {
    fn start() -> Option<Hanging> {
        let runtime = runtime_under_test();
        if runtime != GPUCR_RUNTIME {
            eprintln!("skipped: deadlines are gpucr's, the runtime under test is {runtime}");
            return None;
        }
        let criu = CriuWrapper::install();
        let ctd = Containerd::start_with_env(&[("PATH", criu.path_env())]).expect("containerd");
        let image = ctd.import_busybox().expect("busybox image");
        Some(Hanging { ctd, image, criu })
    }

    fn hang(&self, on: bool) {
        if on {
            self.criu.arm(CriuFault::Hang);
        } else {
            self.criu.disarm();
        }
    }

    /// The wrapper processes that hung, none of which may be alive.
    fn assert_hung_ones_killed(&self) {
        self.criu.assert_gone("hung.pids", Duration::from_secs(10));
    }

    fn counter(&self, id: &str) -> u64 {
        let annotations = [
            format!("io.gpucr.checkpoint-timeout-s={DEADLINE_S}"),
            format!("io.gpucr.restore-timeout-s={DEADLINE_S}"),
        ];
        let flags: Vec<&str> = annotations
            .iter()
            .flat_map(|a| ["--annotation", a.as_str()])
            .collect();
        self.ctd
            .run_detached_with(id, &self.image, &flags, &counter_args())
            .expect("ctr run");
        self.ctd.wait_status(id, "RUNNING").unwrap();
        self.ctd.wait_counter_above(id, 3).unwrap()
    }
}

/// Runs `f` and asserts it answered within [`ANSWER_WITHIN`].
fn answers<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let v = f();
    assert!(
        t0.elapsed() < ANSWER_WITHIN,
        "{what} took {:?} while CRIU hung",
        t0.elapsed()
    );
    v
}

fn checkpoint_in_background(
    ctd: &Containerd,
    id: &str,
    reference: &str,
) -> std::thread::JoinHandle<gpucr_tests::Result<gpucr_tests::Output>> {
    let cmd = ctd
        .ctr_cmd()
        .args(["container", "checkpoint", "--task", "--rw", id, reference])
        .timeout(Duration::from_secs(60));
    std::thread::spawn(move || cmd.output())
}

#[test]
fn a_hung_checkpoint_ends_at_its_deadline_and_the_task_runs_on() {
    let Some(h) = Hanging::start() else {
        return;
    };
    let id = unique_id("hang-ck");
    let before = h.counter(&id);
    let pid = h.ctd.task_pid(&id).unwrap();
    h.hang(true);
    let t0 = Instant::now();
    let ck = checkpoint_in_background(&h.ctd, &id, &format!("docker.io/gpucr/hang:{id}"));
    std::thread::sleep(Duration::from_millis(1500));
    // While runc checkpoint hangs: State (ctr task ls), Pids.
    let status = answers("State", || h.ctd.task_status(&id).unwrap());
    assert!(
        matches!(status.as_deref(), Some("RUNNING") | Some("PAUSED")),
        "{status:?}"
    );
    let ps = answers("Pids", || h.ctd.ctr(&["task", "ps", &id]).unwrap());
    assert!(ps.stdout.contains(&pid.to_string()), "{}", ps.stdout);

    let out = ck.join().unwrap().expect("ctr ran");
    let took = t0.elapsed();
    assert!(
        !out.success(),
        "the hung checkpoint must fail: {}",
        out.stdout
    );
    assert!(
        out.stderr
            .contains(&format!("did not finish within {DEADLINE_S}s"))
            // ctr paused the task around the checkpoint: the shim reports runc's real state.
            && out.stderr.contains("left paused"),
        "the error names the step and its deadline: {}",
        out.stderr
    );
    assert!(took < Duration::from_secs(DEADLINE_S + 20), "{took:?}");
    h.assert_hung_ones_killed();

    // The task runs on (ctr resumed it after the failed checkpoint) and counts.
    h.ctd.wait_status(&id, "RUNNING").unwrap();
    let after = h.ctd.read_counter(&id).unwrap();
    assert!(after >= before);
    h.ctd.wait_counter_above(&id, after).unwrap();

    // With CRIU back, the same container checkpoints.
    h.hang(false);
    h.ctd
        .container_checkpoint(&id, &format!("docker.io/gpucr/ok:{id}"), true)
        .expect("checkpoint once CRIU works");
    h.ctd.wait_status(&id, "RUNNING").unwrap();
    h.ctd.remove_container(&id).unwrap();
}

#[test]
fn kill_reaches_a_task_whose_checkpoint_hangs() {
    let Some(h) = Hanging::start() else {
        return;
    };
    let id = unique_id("hang-kill");
    h.counter(&id);
    h.hang(true);
    let ck = checkpoint_in_background(&h.ctd, &id, &format!("docker.io/gpucr/hangk:{id}"));
    std::thread::sleep(Duration::from_millis(1500));
    answers("Kill", || {
        h.ctd.ctr_ok(&["task", "kill", "-s", "KILL", &id]).unwrap()
    });
    let out = ck.join().unwrap().expect("ctr ran");
    assert!(!out.success(), "{}", out.stdout);
    h.ctd.wait_status(&id, "STOPPED").unwrap();
    h.assert_hung_ones_killed();
    h.hang(false);
    h.ctd.remove_container(&id).unwrap();
}

#[test]
fn a_hung_restore_ends_at_its_deadline_and_leaves_nothing() {
    let Some(h) = Hanging::start() else {
        return;
    };
    let id = unique_id("hang-rs");
    let before = h.counter(&id);
    let reference = format!("docker.io/gpucr/hangr:{id}");
    h.ctd
        .container_checkpoint(&id, &reference, true)
        .expect("checkpoint");
    let after = h.ctd.read_counter(&id).unwrap();
    h.ctd.remove_container(&id).unwrap();

    h.hang(true);
    let t0 = Instant::now();
    let out = h
        .ctd
        .ctr(&["container", "restore", "--live", "--rw", &id, &reference])
        .unwrap();
    assert!(!out.success(), "the hung restore must fail: {}", out.stdout);
    assert!(
        out.stderr
            .contains(&format!("did not finish within {DEADLINE_S}s")),
        "the error names the step and its deadline: {}",
        out.stderr
    );
    assert!(t0.elapsed() < Duration::from_secs(DEADLINE_S + 30));
    h.assert_hung_ones_killed();
    // The restore failed in Start: containerd keeps the task CREATED (nothing runs) until
    // its client deletes it, as with runc's shim; runc has nothing of it.
    let status = h.ctd.task_status(&id).unwrap();
    assert!(
        matches!(status.as_deref(), None | Some("CREATED")),
        "{status:?}"
    );
    assert_runc_knows_nothing(&h.ctd, &id);
    let _ = h.ctd.ctr(&["task", "rm", "-f", &id]);
    let _ = h.ctd.ctr(&["container", "rm", &id]);

    // The checkpoint is intact: with CRIU back it restores.
    h.hang(false);
    let restored_at = Instant::now();
    h.ctd
        .container_restore(&id, &reference, true)
        .expect("restore once CRIU works");
    h.ctd.wait_status(&id, "RUNNING").unwrap();
    let first = h.ctd.wait_counter_above(&id, 0).unwrap();
    let slack = restored_at.elapsed().as_millis() as u64 / 150 + 3;
    assert!(
        first >= before && first <= after + slack,
        "restored counter {first}; checkpointed between {before} and {after}"
    );
    h.ctd.remove_container(&id).unwrap();
}

fn assert_runc_knows_nothing(ctd: &Containerd, id: &str) {
    let root = Path::new("/run/containerd/runc").join(ctd.namespace());
    assert!(
        !root.join(id).exists(),
        "runc still has state for {id} under {}",
        root.display()
    );
}
