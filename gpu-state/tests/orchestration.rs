//! GpuProcessSet against the scripted fake libcuda: call order and every rollback path.

mod common;

use std::time::Duration;

use common::Fake;
use gpu_state::process::{FailureKind, StepTimeouts};
use gpu_state::{
    DriverError, GpuCheckpointRecord, GpuPair, GpuProcessSet, GpuUuid, OrchestrationError,
    ProcessState, Step,
};

const THREE: &str = "cuda 1001\ncuda 1002\ncuda 1003\n";

fn fast() -> StepTimeouts {
    StepTimeouts {
        lock: Duration::from_secs(2),
        checkpoint: Duration::from_secs(5),
        restore: Duration::from_secs(5),
        unlock: Duration::from_secs(5),
        query: Duration::from_secs(5),
        grace: Duration::from_secs(2),
    }
}

fn set(fake: &Fake, t: StepTimeouts) -> GpuProcessSet {
    GpuProcessSet::discover(fake.driver(), &[1001, 1002, 1003, 77], t).unwrap()
}

fn assert_all_running(fake: &Fake) {
    for pid in [1001, 1002, 1003] {
        assert_eq!(fake.state(pid), ProcessState::Running, "pid {pid}");
    }
}

/// Index of the first log line starting with `prefix`.
fn pos(calls: &[String], prefix: &str) -> usize {
    calls
        .iter()
        .position(|c| c.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in {calls:#?}"))
}

#[test]
fn full_cycle_in_order_and_record() {
    let fake = Fake::new(THREE);
    let mut s = set(&fake, fast());
    assert_eq!(s.pids(), vec![1001, 1002, 1003], "77 is not a CUDA process");
    s.lock_all(Duration::from_secs(10)).unwrap();
    s.checkpoint_all().unwrap();
    for pid in [1001, 1002, 1003] {
        assert_eq!(fake.state(pid), ProcessState::Checkpointed);
    }
    s.restore_all(&[]).unwrap();
    s.unlock_all().unwrap();
    assert_all_running(&fake);

    let calls = fake.calls();
    assert_eq!(calls.len(), 12, "{calls:#?}");
    assert!(calls.iter().all(|c| c.ends_with("-> 0")), "{calls:#?}");
    // Each step finishes on every process before the next starts.
    for pid in [1001, 1002, 1003] {
        assert!(pos(&calls, "unlock") > pos(&calls, &format!("restore {pid}")));
        assert!(pos(&calls, "restore") > pos(&calls, &format!("checkpoint {pid}")));
        assert!(pos(&calls, "checkpoint") > pos(&calls, &format!("lock {pid}")));
    }

    let rec = s.record(None);
    assert_eq!(rec.processes.len(), 3);
    assert_eq!(rec.processes[0].steps.len(), 4);
    assert_eq!(rec.cuda_driver_version, Some(13000));
    rec.save(fake.dir.path()).unwrap();
    let back = GpuCheckpointRecord::load(fake.dir.path()).unwrap();
    assert_eq!(back.processes[1].steps[1].step, Step::Checkpoint);
}

#[test]
fn lock_failure_unlocks_the_others() {
    let fake = Fake::new(&format!("{THREE}lock 1002 fail 2\n"));
    let mut s = set(&fake, fast());
    let err = s.lock_all(Duration::from_secs(10)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("pid 1002") && msg.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{msg}"
    );
    assert!(msg.contains("rolled back"), "{msg}");
    assert!(err.unrecovered_pids().is_empty());
    assert_all_running(&fake);
    let calls = fake.calls();
    assert!(
        calls.contains(&"unlock 1001 -> 0".to_string()),
        "{calls:#?}"
    );
    assert!(
        calls.contains(&"unlock 1003 -> 0".to_string()),
        "{calls:#?}"
    );
    assert!(
        !calls.iter().any(|c| c.starts_with("unlock 1002")),
        "{calls:#?}"
    );
}

#[test]
fn lock_timeout_in_the_driver() {
    // The driver gives up after timeoutMs with NOT_READY and leaves the process RUNNING.
    let fake = Fake::new(&format!("{THREE}lock 1003 hang 5000\n"));
    let mut s = set(&fake, fast());
    let t0 = std::time::Instant::now();
    let err = s.lock_all(Duration::from_millis(200)).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t0.elapsed()
    );
    assert!(
        err.to_string().contains("600 CUDA_ERROR_NOT_READY"),
        "{err}"
    );
    assert!(err.unrecovered_pids().is_empty(), "{err}");
    assert_all_running(&fake);
}

#[test]
fn checkpoint_fails_for_the_second_of_three() {
    let fake = Fake::new(&format!("{THREE}checkpoint 1002 fail 999\n"));
    let mut s = set(&fake, fast());
    s.lock_all(Duration::from_secs(10)).unwrap();
    let err = s.checkpoint_all().unwrap_err();
    let OrchestrationError::StepFailed {
        step,
        failures,
        rollback,
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(*step, Step::Checkpoint);
    assert_eq!(failures.0.len(), 1);
    assert_eq!(failures.0[0].pid, 1002);
    assert!(rollback.is_clean(), "{err}");
    assert_all_running(&fake);
    let calls = fake.calls();
    for pid in [1001, 1003] {
        assert!(calls.contains(&format!("restore {pid} -> 0")), "{calls:#?}");
    }
    assert!(
        !calls.iter().any(|c| c.starts_with("restore 1002")),
        "{calls:#?}"
    );
    for pid in [1001, 1002, 1003] {
        assert!(calls.contains(&format!("unlock {pid} -> 0")), "{calls:#?}");
    }
}

#[test]
fn checkpoint_past_deadline_is_settled_then_rolled_back() {
    let fake = Fake::new(&format!("{THREE}checkpoint 1002 hang 800\n"));
    let mut t = fast();
    t.checkpoint = Duration::from_millis(200);
    let mut s = set(&fake, t);
    s.lock_all(Duration::from_secs(10)).unwrap();
    let err = s.checkpoint_all().unwrap_err();
    let OrchestrationError::StepFailed {
        failures, rollback, ..
    } = &err
    else {
        panic!("{err}")
    };
    assert!(
        matches!(failures.0[0].kind, FailureKind::TimedOut { .. }),
        "{err}"
    );
    assert!(rollback.is_clean(), "{err}");
    assert_all_running(&fake);
}

#[test]
fn call_that_never_returns_is_named() {
    let fake = Fake::new(&format!("{THREE}checkpoint 1002 hang 4000\n"));
    let mut t = fast();
    t.checkpoint = Duration::from_millis(200);
    t.grace = Duration::from_millis(200);
    let mut s = set(&fake, t);
    s.lock_all(Duration::from_secs(10)).unwrap();
    let err = s.checkpoint_all().unwrap_err();
    assert_eq!(err.unrecovered_pids(), vec![1002], "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("pid 1002 could not be brought back to RUNNING"),
        "{msg}"
    );
    for pid in [1001, 1003] {
        assert_eq!(fake.state(pid), ProcessState::Running);
    }
    // Let the hung call finish before the temp dir goes away.
    std::thread::sleep(Duration::from_millis(4000));
}

#[test]
fn restore_fails_once_then_rollback_retries() {
    let fake = Fake::new(
        "cuda 1001 state=checkpointed\ncuda 1002 state=checkpointed\ncuda 1003 state=checkpointed\nrestore 1002 call=1 fail 2\n",
    );
    let mut s = set(&fake, fast());
    assert!(s
        .processes()
        .iter()
        .all(|p| p.initial_state == ProcessState::Checkpointed));
    let err = s.resume_all(&[]).unwrap_err();
    assert!(err.unrecovered_pids().is_empty(), "{err}");
    assert_all_running(&fake);
}

#[test]
fn restore_keeps_failing_names_the_pid() {
    let fake = Fake::new(
        "cuda 1001 state=checkpointed\ncuda 1002 state=checkpointed\ncuda 1003 state=checkpointed\nrestore 1002 fail 304\n",
    );
    let mut s = set(&fake, fast());
    let err = s.restore_all(&[]).unwrap_err();
    assert_eq!(err.unrecovered_pids(), vec![1002]);
    let msg = err.to_string();
    assert!(msg.contains("304 CUDA_ERROR_OPERATING_SYSTEM"), "{msg}");
    assert!(
        msg.contains("pid 1002 could not be brought back to RUNNING (left CHECKPOINTED)"),
        "{msg}"
    );
    assert_eq!(fake.state(1001), ProcessState::Running);
    assert_eq!(fake.state(1003), ProcessState::Running);
}

#[test]
fn unlock_fails_once_is_retried() {
    let fake = Fake::new(&format!("{THREE}unlock 1001 call=1 fail 999\n"));
    let mut s = set(&fake, fast());
    s.lock_all(Duration::from_secs(10)).unwrap();
    let err = s.unlock_all().unwrap_err();
    assert!(err.unrecovered_pids().is_empty(), "{err}");
    assert_all_running(&fake);
}

#[test]
fn unlock_keeps_failing_names_the_pid() {
    let fake = Fake::new(&format!("{THREE}unlock 1003 fail 999\n"));
    let mut s = set(&fake, fast());
    s.lock_all(Duration::from_secs(10)).unwrap();
    s.checkpoint_all().unwrap();
    s.restore_all(&[]).unwrap();
    let err = s.unlock_all().unwrap_err();
    assert_eq!(err.unrecovered_pids(), vec![1003]);
    assert!(err.to_string().contains("left LOCKED"), "{err}");
    assert_eq!(fake.state(1003), ProcessState::Locked);
}

#[test]
fn gpu_pairs_need_a_13_driver() {
    let pair = GpuPair {
        old: GpuUuid::parse("GPU-00000000-0000-0000-0000-000000000001").unwrap(),
        new: GpuUuid::parse("GPU-00000000-0000-0000-0000-000000000002").unwrap(),
    };
    let fake = Fake::new("driver_version 12080\ncuda 1001 state=checkpointed\n");
    let mut s = GpuProcessSet::discover(fake.driver(), &[1001], fast()).unwrap();
    let err = s.restore_all(&[pair]).unwrap_err();
    assert!(
        matches!(
            err,
            OrchestrationError::Driver(DriverError::GpuPairsUnsupported {
                driver_version: 12080
            })
        ),
        "{err}"
    );
    assert!(fake.calls().is_empty(), "nothing was called");
    // The direct API refuses too, and a 12.8 restore without pairs works.
    let api = fake.driver();
    assert!(matches!(
        api.restore(1001, &[pair]),
        Err(DriverError::GpuPairsUnsupported { .. })
    ));
    api.restore(1001, &[]).unwrap();
    drop(fake);

    let fake = Fake::new("driver_version 13000\ncuda 1001 state=checkpointed\n");
    let mut s = GpuProcessSet::discover(fake.driver(), &[1001], fast()).unwrap();
    s.restore_all(&[pair]).unwrap();
    assert_eq!(fake.calls(), vec!["restore 1001 pairs=1 -> 0".to_string()]);
}
