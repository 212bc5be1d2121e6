//! Checkpoint and restore through `ctr`; the counter workload must continue from the
//! checkpointed value after every restore.
//!
//! containerd 1.7's ctr cannot restore a `ctr task checkpoint` image or an `--image-path`
//! directory by itself; the harness repackages those as container checkpoint images and
//! restores them with `ctr container restore --live` (see `gpucr_tests::checkpoint`).
//!
//! containerd 1.7's ctr also drops `--exit`, `--image-path` and `--work-path` for runtimes not
//! named `io.containerd.runc.*`; for gpucr those tests send the request containerd 2.x's daemon
//! forwards for them straight to the shim (`Containerd::checkpoint_with_flags`).

use std::time::{Duration, Instant};

use gpucr_tests::{
    setup,
    shim_client::{CheckpointFlags, CheckpointOutcome},
    unique_id, Containerd,
};

/// Counter value a workload reaches before a checkpoint: far above what a workload restarted
/// from 0 could reach between restore and the first read.
const WARM_COUNT: u64 = 8;

/// Asserts the restored workload continues from the checkpoint: its first value lies between
/// the last value read before the checkpoint and the first one after it (plus what it can have
/// counted since the restore), and it keeps counting.
fn assert_continues(ctd: &Containerd, id: &str, before: u64, after: u64, restored_at: Instant) {
    ctd.wait_status(id, "RUNNING").expect("restored task runs");
    // Without the rw layer the counter file reappears at the next increment.
    let first = ctd
        .wait_counter_above(id, 0)
        .expect("read restored counter");
    let slack = restored_at.elapsed().as_millis() as u64 / 150 + 3;
    assert!(
        first >= before && first <= after + slack,
        "restored counter of {id} is {first}; checkpointed between {before} and {after} \
         (+{slack} since restore)"
    );
    ctd.wait_counter_above(id, first)
        .expect("restored workload keeps counting");
}

fn warm_counter(ctd: &Containerd, id: &str, image: &str) -> u64 {
    ctd.run_counter(id, image).expect("run counter");
    ctd.wait_counter_above(id, WARM_COUNT)
        .expect("counter warms up")
}

#[test]
fn task_checkpoint_leave_running_then_restore() {
    let (ctd, image) = setup();
    let id = unique_id("ck-run");
    let before = warm_counter(&ctd, &id, &image);
    let checkpoint = ctd
        .task_checkpoint(&id, &[])
        .expect("ctr task checkpoint")
        .expect("checkpoint image stored");
    // Without --exit the task keeps running and counting.
    ctd.wait_status(&id, "RUNNING").unwrap();
    let after = ctd.read_counter(&id).unwrap();
    ctd.wait_counter_above(&id, after).unwrap();

    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.restore_task_checkpoint(&id, &checkpoint, true)
        .expect("restore");
    assert_continues(&ctd, &id, before, after, restored_at);
    ctd.remove_container(&id).unwrap();
}

#[test]
fn task_checkpoint_exit_then_restore() {
    let (ctd, image) = setup();
    let id = unique_id("ck-exit");
    let before = warm_counter(&ctd, &id, &image);
    let spec = ctd.container_spec(&id).unwrap();
    let flags = CheckpointFlags {
        exit: true,
        ..Default::default()
    };
    let checkpoint = ctd
        .checkpoint_with_flags(&id, &flags)
        .expect("ctr task checkpoint --exit");
    ctd.wait_status(&id, "STOPPED")
        .expect("--exit stops the task");
    let pid = ctd.task_pid(&id).unwrap_or(0) as i32;
    assert!(
        pid == 0 || !gpucr_tests::procfs::is_alive(pid),
        "init {pid} survived --exit"
    );

    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.restore_outcome(&id, &checkpoint, &image, &spec)
        .expect("restore");
    // With --exit nothing ran after the dump: the checkpointed value is at most one past the
    // last read.
    assert_continues(&ctd, &id, before, before + 2, restored_at);
    ctd.remove_container(&id).unwrap();
}

#[test]
fn task_checkpoint_image_path_and_work_path_then_restore() {
    let (ctd, image) = setup();
    let id = unique_id("ck-path");
    let image_path = ctd.dir().join("ck-images");
    let work_path = ctd.dir().join("ck-work");
    let before = warm_counter(&ctd, &id, &image);
    let spec = ctd.container_spec(&id).unwrap();
    let flags = CheckpointFlags {
        image_path: Some(&image_path),
        work_path: Some(&work_path),
        ..Default::default()
    };
    let stored = ctd
        .checkpoint_with_flags(&id, &flags)
        .expect("ctr task checkpoint --image-path --work-path");
    // containerd 2.x's client stores an index anyway (the image's manifest, no CRIU data) for
    // a runtime other than io.containerd.runc.v2 (client/task.go::isCheckpointPathExist).
    let client_stores_index = ctd.major() >= 2 && ctd.runtime() != gpucr_tests::RUNC_RUNTIME;
    match &stored {
        CheckpointOutcome::Stored(_) if client_stores_index => {}
        other => assert_eq!(
            other,
            &CheckpointOutcome::Dir(image_path.clone()),
            "with --image-path nothing goes to the content store"
        ),
    }
    assert!(
        image_path.join("inventory.img").is_file(),
        "CRIU images in {}",
        image_path.display()
    );
    assert!(
        work_path.join("dump.log").is_file(),
        "CRIU log in {}",
        work_path.display()
    );
    ctd.wait_status(&id, "RUNNING").unwrap();
    let after = ctd.read_counter(&id).unwrap();

    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.restore_from_image_path(&id, &image_path, &image, &spec)
        .expect("restore from the image path");
    assert_continues(&ctd, &id, before, after, restored_at);
    ctd.remove_container(&id).unwrap();
}

#[test]
fn task_checkpoint_image_path_exit() {
    let (ctd, image) = setup();
    let id = unique_id("ck-path-exit");
    let image_path = ctd.dir().join("ck-images");
    let before = warm_counter(&ctd, &id, &image);
    let spec = ctd.container_spec(&id).unwrap();
    let flags = CheckpointFlags {
        exit: true,
        image_path: Some(&image_path),
        ..Default::default()
    };
    ctd.checkpoint_with_flags(&id, &flags)
        .expect("ctr task checkpoint --exit --image-path");
    ctd.wait_status(&id, "STOPPED").unwrap();
    assert!(image_path.join("inventory.img").is_file());

    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.restore_from_image_path(&id, &image_path, &image, &spec)
        .expect("restore from the image path");
    assert_continues(&ctd, &id, before, before + 2, restored_at);
    ctd.remove_container(&id).unwrap();
}

#[test]
fn container_checkpoint_rw_then_live_restore_twice() {
    let (ctd, image) = setup();
    let id = unique_id("ck-ctr");
    let reference = format!("docker.io/gpucr/ckpt-{id}:1");
    let before = warm_counter(&ctd, &id, &image);
    ctd.exec(&id, &["sh", "-c", "echo kept > /root/marker"])
        .unwrap()
        .check()
        .unwrap();
    ctd.container_checkpoint(&id, &reference, true)
        .expect("ctr container checkpoint --task --rw");
    let after = ctd.read_counter(&id).unwrap();

    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.container_restore(&id, &reference, true)
        .expect("ctr container restore --live --rw");
    assert_continues(&ctd, &id, before, after, restored_at);
    ctd.wait_unpacked_removed()
        .expect("the restore's unpacked checkpoint is removed");
    let marker = ctd.exec(&id, &["cat", "/root/marker"]).unwrap();
    assert_eq!(
        marker.stdout.trim(),
        "kept",
        "--rw restores the rootfs: {marker:?}"
    );

    // A second checkpoint, of the restored container. containerd 1.7 stores no CRIU tar when
    // an identical spec blob is still referenced, so the first image goes first.
    let before = ctd.wait_counter_above(&id, 0).unwrap();
    ctd.remove_image(&reference).unwrap();
    let reference2 = format!("docker.io/gpucr/ckpt-{id}:2");
    ctd.container_checkpoint(&id, &reference2, true)
        .expect("second checkpoint");
    let after = ctd.read_counter(&id).unwrap();
    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.container_restore(&id, &reference2, true)
        .expect("second restore");
    assert_continues(&ctd, &id, before, after, restored_at);
    ctd.wait_unpacked_removed()
        .expect("the second restore's copy is removed");
    ctd.remove_container(&id).unwrap();
}

#[test]
fn checkpoint_of_paused_task_stays_paused() {
    let (ctd, image) = setup();
    let id = unique_id("ck-paused");
    warm_counter(&ctd, &id, &image);
    ctd.ctr_ok(&["task", "pause", &id]).unwrap();
    ctd.wait_status(&id, "PAUSED").unwrap();
    // exec cannot run in a frozen cgroup: take the last count the workload logged.
    let log = ctd.container_log(&id);
    let frozen = log
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("count ")?.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no count in the log: {log:?}"));
    let checkpoint = ctd
        .task_checkpoint(&id, &[])
        .expect("checkpoint of a paused task")
        .expect("checkpoint image stored");
    assert_eq!(
        ctd.task_status(&id).unwrap().as_deref(),
        Some("PAUSED"),
        "a paused task stays paused after a checkpoint"
    );
    std::thread::sleep(Duration::from_millis(500));
    ctd.ctr_ok(&["task", "resume", &id]).unwrap();
    ctd.wait_status(&id, "RUNNING").unwrap();
    ctd.wait_counter_above(&id, frozen).unwrap();

    ctd.remove_container(&id).unwrap();
    let restored_at = Instant::now();
    ctd.restore_task_checkpoint(&id, &checkpoint, true)
        .expect("restore");
    assert_continues(&ctd, &id, frozen, frozen + 1, restored_at);
    ctd.remove_container(&id).unwrap();
}

#[test]
fn restored_task_checkpoints_again() {
    let (ctd, image) = setup();
    let id = unique_id("ck-again");
    let mut before = warm_counter(&ctd, &id, &image);
    let spec = ctd.container_spec(&id).unwrap();
    let mut previous: Option<CheckpointOutcome> = None;
    for round in 0..2 {
        if let Some(CheckpointOutcome::Stored(old)) = previous.take() {
            // containerd 1.7: a second task checkpoint with the same spec blob fails with
            // "content ... already exists" unless the older image is gone.
            ctd.remove_image(&old).unwrap();
        }
        let dir = ctd.dir().join(format!("round-{round}"));
        let flags = CheckpointFlags {
            exit: true,
            // Without ctr forwarding the flags, each round needs a directory of its own.
            image_path: (!ctd.ctr_forwards_checkpoint_flags()).then_some(dir.as_path()),
            ..Default::default()
        };
        let checkpoint = ctd
            .checkpoint_with_flags(&id, &flags)
            .unwrap_or_else(|e| panic!("checkpoint round {round}: {e}"));
        ctd.wait_status(&id, "STOPPED").unwrap();
        ctd.remove_container(&id).unwrap();
        let restored_at = Instant::now();
        ctd.restore_outcome(&id, &checkpoint, &image, &spec)
            .unwrap_or_else(|e| panic!("restore round {round}: {e}"));
        assert_continues(&ctd, &id, before, before + 2, restored_at);
        before = ctd.wait_counter_above(&id, before + 3).unwrap();
        previous = Some(checkpoint);
    }
    ctd.remove_container(&id).unwrap();
}

/// The cgroup `pid` is in: cgroup v1's `pids` hierarchy where there is one, else v2's.
fn cgroup_of(pid: u32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.contains(prefix))
            .map(|l| l.rsplit(':').next().unwrap().to_owned())
    };
    line(":pids:")
        .or_else(|| line("0::"))
        .unwrap_or_else(|| panic!("no cgroup of {pid}: {text}"))
}

/// The spec a restore gets is the checkpoint's, whose linux.cgroupsPath names the original
/// container (as with containerd's runc shim): the shim renames it at Create (#27.7).
#[test]
fn one_checkpoint_restored_twice_gets_two_cgroups() {
    let (ctd, image) = setup();
    if ctd.runtime() != gpucr_tests::GPUCR_RUNTIME {
        eprintln!("skipped: containerd's runc shim keeps the checkpoint's cgroup");
        return;
    }
    let id = unique_id("ck-cg");
    let reference = format!("docker.io/gpucr/ckpt-{id}:1");
    warm_counter(&ctd, &id, &image);
    ctd.container_checkpoint(&id, &reference, true)
        .expect("ctr container checkpoint --task --rw");
    ctd.remove_container(&id).unwrap();
    let (a, b) = (format!("{id}-a"), format!("{id}-b"));
    for r in [&a, &b] {
        ctd.container_restore(r, &reference, true)
            .expect("ctr container restore --live --rw");
        ctd.wait_status(r, "RUNNING").unwrap();
    }
    let (ca, cb) = (
        cgroup_of(ctd.task_pid(&a).unwrap()),
        cgroup_of(ctd.task_pid(&b).unwrap()),
    );
    let runc_paths = |r: &str| {
        let state = std::path::Path::new("/run/containerd/runc")
            .join(ctd.namespace())
            .join(r)
            .join("state.json");
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(state).unwrap_or_default()).unwrap_or_default();
        v["cgroup_paths"].to_string()
    };
    assert_ne!(
        ca,
        cb,
        "two restores of one checkpoint share a cgroup; runc's paths: {} / {}",
        runc_paths(&a),
        runc_paths(&b)
    );
    assert!(ca.ends_with(&a) && cb.ends_with(&b), "{ca} {cb}");
    for r in [&a, &b] {
        ctd.remove_container(r).unwrap();
    }
}
