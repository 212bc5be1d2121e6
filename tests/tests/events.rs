//! Task events reach containerd: `ctr events` sees every topic the shim publishes over one
//! container's life, including TaskOOM from the cgroup's OOM killer.

use std::{
    io::Read,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use gpucr_tests::{setup, unique_id, Containerd};

/// `ctr events` running in the background; its output is read when it is stopped.
struct EventStream(Child);

impl EventStream {
    fn start(ctd: &Containerd) -> Self {
        let child = Command::new(&ctd.daemon().ctr)
            .arg("-a")
            .arg(ctd.address())
            .args(["-n", ctd.namespace(), "events"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ctr events");
        // Let the subscription reach the daemon before anything happens.
        std::thread::sleep(Duration::from_millis(300));
        EventStream(child)
    }

    fn stop(mut self) -> String {
        std::thread::sleep(Duration::from_millis(500));
        let _ = self.0.kill();
        let mut out = String::new();
        self.0
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let _ = self.0.wait();
        out
    }
}

fn topics_for(events: &str, id: &str) -> Vec<String> {
    events
        .lines()
        .filter(|l| l.contains(&format!("\"container_id\":\"{id}\"")))
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("/tasks/")))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_task_event_is_published() {
    let (ctd, image) = setup();
    let id = unique_id("events");
    let stream = EventStream::start(&ctd);
    ctd.run_counter(&id, &image).unwrap();
    ctd.exec(&id, &["true"]).unwrap().check().unwrap();
    ctd.ctr_ok(&["task", "pause", &id]).unwrap();
    ctd.ctr_ok(&["task", "resume", &id]).unwrap();
    ctd.task_checkpoint(&id, &[]).unwrap();
    ctd.remove_container(&id).unwrap();
    let events = stream.stop();
    let topics = topics_for(&events, &id);
    // containerd's Go runc shim does not publish TaskCheckpointed; gpucr does.
    let gpucr = ctd.runtime() == gpucr_tests::GPUCR_RUNTIME;
    for want in [
        "/tasks/create",
        "/tasks/start",
        "/tasks/exec-added",
        "/tasks/exec-started",
        "/tasks/paused",
        "/tasks/resumed",
        "/tasks/checkpointed",
        "/tasks/exit",
        "/tasks/delete",
    ] {
        if want == "/tasks/checkpointed" && !gpucr {
            continue;
        }
        assert!(
            topics.iter().any(|t| t == want),
            "{want} missing from {topics:?}\n{events}"
        );
    }
    // The init exit is reported exactly once (the exec's exit is its own event).
    let init_exits = events
        .lines()
        .filter(|l| l.contains("/tasks/exit") && l.contains(&format!("\"id\":\"{id}\"")))
        .count();
    assert_eq!(init_exits, 1, "{events}");
}

#[test]
fn oom_kill_is_reported() {
    let (ctd, image) = setup();
    let id = unique_id("oom");
    let stream = EventStream::start(&ctd);
    let started = Instant::now();
    // dd's 64 MiB buffer cannot fit under a 16 MiB limit: the kernel kills dd.
    let out = ctd
        .ctr_cmd()
        .args(["run", "--rm", "--memory-limit", "16777216"])
        .args(ctd.run_flags())
        .args([
            image.as_str(),
            id.as_str(),
            "sh",
            "-c",
            "sleep 0.3; dd if=/dev/zero of=/dev/null bs=64M count=1; echo dd=$?",
        ])
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    assert!(out.stdout.contains("dd=137"), "dd was OOM-killed: {out:?}");
    let events = stream.stop();
    assert!(
        topics_for(&events, &id).iter().any(|t| t == "/tasks/oom"),
        "TaskOOM within {:?}: {events}",
        started.elapsed()
    );
}
