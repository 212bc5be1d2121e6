//! Task lifecycle through `ctr --runtime <runtime under test>`: run, list, exec, kill, exit
//! status, pids, pause/resume, update and metrics.

use std::time::Duration;

use gpucr_tests::{poll_until, setup, unique_id};

const SLEEPER: &str = "trap 'exit 42' TERM; while true; do sleep 0.1; done";

fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

#[test]
fn run_detached_lists_running_task() {
    let (ctd, image) = setup();
    let id = unique_id("run");
    ctd.run_counter(&id, &image).expect("run counter");
    let pid = ctd.task_pid(&id).expect("task pid");
    assert!(pid > 0, "task {id} has pid {pid}");
    assert_eq!(ctd.task_status(&id).unwrap().as_deref(), Some("RUNNING"));
    let listed = ctd.ctr_ok(&["container", "ls", "-q"]).unwrap().stdout;
    assert!(listed.lines().any(|l| l == id), "container ls: {listed}");
    let info = ctd.ctr_ok(&["container", "info", &id]).unwrap().stdout;
    assert!(
        info.contains(ctd.runtime()),
        "container info names the runtime: {info}"
    );
    // The workload's stdout reaches the log URI.
    poll_until("log has a count", Duration::from_secs(10), || {
        let log = ctd.container_log(&id);
        Ok(if log.contains("count ") {
            Ok(())
        } else {
            Err(log)
        })
    })
    .unwrap();
    ctd.remove_container(&id).expect("remove");
}

#[test]
fn exec_returns_output_and_status() {
    let (ctd, image) = setup();
    let id = unique_id("exec");
    ctd.run_detached(&id, &image, &sh(SLEEPER)).unwrap();
    ctd.wait_status(&id, "RUNNING").unwrap();

    let out = ctd.exec(&id, &["echo", "hello from exec"]).unwrap();
    assert!(out.success(), "{out:?}");
    assert_eq!(out.stdout.trim(), "hello from exec");

    let out = ctd
        .exec(&id, &["sh", "-c", "echo oops >&2; exit 3"])
        .unwrap();
    assert_eq!(out.code, Some(3), "exec exit status: {out:?}");
    assert!(out.stderr.contains("oops"), "exec stderr: {out:?}");

    // An exec sees the init process's filesystem and pid namespace.
    let out = ctd
        .exec(&id, &["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '"])
        .unwrap();
    assert!(out.stdout.contains("sh -c"), "{out:?}");
    ctd.remove_container(&id).unwrap();
}

#[test]
fn kill_then_delete_reports_exit_status() {
    let (ctd, image) = setup();
    let id = unique_id("kill");
    ctd.run_detached(&id, &image, &sh(SLEEPER)).unwrap();
    ctd.wait_status(&id, "RUNNING").unwrap();
    let pid = ctd.task_pid(&id).unwrap() as i32;

    ctd.ctr_ok(&["task", "kill", "-s", "SIGTERM", &id]).unwrap();
    ctd.wait_status(&id, "STOPPED").unwrap();
    assert!(
        !gpucr_tests::procfs::is_alive(pid),
        "init {pid} still alive"
    );
    let out = ctd.ctr_ok(&["task", "rm", &id]).unwrap();
    assert!(
        out.stderr.contains("exit code 42") || out.stdout.contains("42"),
        "task rm reports the exit status: {out:?}"
    );
    assert_eq!(ctd.task_status(&id).unwrap(), None);
    ctd.ctr_ok(&["container", "rm", &id]).unwrap();
}

#[test]
fn foreground_run_returns_exit_status() {
    let (ctd, image) = setup();
    let id = unique_id("wait");
    let out = ctd
        .ctr_cmd()
        .args(["run", "--rm"])
        .args(ctd.run_flags())
        .args([image.as_str(), id.as_str(), "sh", "-c", "echo done; exit 7"])
        .output()
        .unwrap();
    assert_eq!(
        out.code,
        Some(7),
        "ctr run waits and returns the status: {out:?}"
    );
    assert_eq!(out.stdout.trim(), "done");

    // A task killed while `ctr run` waits on it reports 128 + SIGKILL.
    let id = unique_id("wait-kill");
    let out = std::thread::scope(|scope| {
        let runner = scope.spawn(|| {
            ctd.ctr_cmd()
                .args(["run", "--rm"])
                .args(ctd.run_flags())
                .args([image.as_str(), id.as_str(), "sh", "-c", SLEEPER])
                .output()
        });
        ctd.wait_status(&id, "RUNNING").unwrap();
        ctd.ctr_ok(&["task", "kill", "-s", "SIGKILL", &id]).unwrap();
        runner.join().expect("ctr run thread").unwrap()
    });
    assert_eq!(out.code, Some(137), "{out:?}");
}

#[test]
fn pids_lists_init_and_exec() {
    let (ctd, image) = setup();
    let id = unique_id("pids");
    ctd.run_detached(&id, &image, &sh(SLEEPER)).unwrap();
    ctd.wait_status(&id, "RUNNING").unwrap();
    let init = ctd.task_pid(&id).unwrap();
    // A long-running exec shows up as a second process.
    let exec = std::thread::scope(|scope| {
        let runner = scope.spawn(|| ctd.exec(&id, &["sleep", "3"]));
        let pids = poll_until("two pids", Duration::from_secs(10), || {
            let out = ctd.ctr_ok(&["task", "ps", &id])?;
            let pids: Vec<u32> = out
                .stdout
                .lines()
                .skip(1)
                .filter_map(|l| l.split_whitespace().next()?.parse().ok())
                .collect();
            Ok(if pids.len() >= 2 { Ok(pids) } else { Err(pids) })
        })
        .unwrap();
        assert!(pids.contains(&init), "ps {pids:?} lacks init {init}");
        runner.join().expect("exec thread")
    });
    assert!(exec.unwrap().success());
    ctd.remove_container(&id).unwrap();
}

#[test]
fn pause_and_resume() {
    let (ctd, image) = setup();
    let id = unique_id("pause");
    ctd.run_counter(&id, &image).unwrap();
    ctd.ctr_ok(&["task", "pause", &id]).unwrap();
    ctd.wait_status(&id, "PAUSED").unwrap();
    let log_before = ctd.container_log(&id).len();
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(
        ctd.container_log(&id).len(),
        log_before,
        "a paused task kept writing"
    );
    ctd.ctr_ok(&["task", "resume", &id]).unwrap();
    ctd.wait_status(&id, "RUNNING").unwrap();
    let counter = ctd.read_counter(&id).unwrap();
    ctd.wait_counter_above(&id, counter).unwrap();
    ctd.remove_container(&id).unwrap();
}

#[test]
fn metrics_report_cgroup_stats() {
    let (ctd, image) = setup();
    let id = unique_id("metrics");
    ctd.run_counter(&id, &image).unwrap();
    let out = ctd.ctr_ok(&["task", "metrics", &id]).unwrap();
    assert!(out.stdout.contains("memory"), "metrics: {}", out.stdout);
    assert!(out.stdout.contains("pids"), "metrics: {}", out.stdout);
    let json = ctd
        .ctr_ok(&["task", "metrics", "--format", "json", &id])
        .unwrap();
    let value: serde_json::Value = serde_json::from_str(&json.stdout).expect("metrics JSON");
    assert!(value.is_object(), "metrics JSON: {value}");
    ctd.remove_container(&id).unwrap();
}

#[test]
fn update_memory_limit() {
    // ctr 1.7 has no `task update`; the harness sends the shim's Update RPC the way
    // containerd's Task.Update forwards it, and checks the limit through Stats (`ctr task
    // metrics`).
    let (ctd, image) = setup();
    let id = unique_id("update");
    ctd.run_counter(&id, &image).unwrap();
    let limit: u64 = 96 * 1024 * 1024;
    ctd.update_memory_limit(&id, limit).expect("Update RPC");
    let out = ctd.ctr_ok(&["task", "metrics", &id]).unwrap();
    assert!(
        out.stdout.contains(&limit.to_string()),
        "metrics show the new limit {limit}: {}",
        out.stdout
    );
    ctd.read_counter(&id).expect("task survives the update");
    ctd.remove_container(&id).unwrap();
}
