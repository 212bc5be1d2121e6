//! Standard streams and terminals through `ctr run`.

use gpucr_tests::{setup, unique_id, Cmd};

#[test]
fn stdin_reaches_the_container_and_stdout_comes_back() {
    let (ctd, image) = setup();
    let id = unique_id("stdin");
    let out = ctd
        .ctr_cmd()
        .args(["run", "--rm"])
        .args(ctd.run_flags())
        .args([
            image.as_str(),
            id.as_str(),
            "sh",
            "-c",
            "read a; read b; echo \"got $a\"; echo \"$b\"",
        ])
        // ctr 1.7 does not close the task's stdin at EOF, so read a known number of lines.
        .stdin("hi there\nsecond line\n")
        .run_ok()
        .expect("ctr run with stdin");
    assert_eq!(out.stdout, "got hi there\nsecond line\n");
}

#[test]
fn stdout_and_stderr_stay_apart() {
    let (ctd, image) = setup();
    let id = unique_id("stderr");
    let out = ctd
        .ctr_cmd()
        .args(["run", "--rm"])
        .args(ctd.run_flags())
        .args([
            image.as_str(),
            id.as_str(),
            "sh",
            "-c",
            "echo to-out; echo to-err >&2; echo again-err 1>&2",
        ])
        .run_ok()
        .expect("ctr run");
    assert_eq!(out.stdout, "to-out\n");
    assert_eq!(out.stderr, "to-err\nagain-err\n");
}

#[test]
fn large_output_is_not_truncated() {
    let (ctd, image) = setup();
    let id = unique_id("bigout");
    let out = ctd
        .ctr_cmd()
        .args(["run", "--rm"])
        .args(ctd.run_flags())
        .args([image.as_str(), id.as_str(), "sh", "-c", "seq 1 20000"])
        .run_ok()
        .expect("ctr run");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 20000);
    assert_eq!(lines.last(), Some(&"20000"));
}

#[test]
fn terminal_gives_a_pty() {
    let (ctd, image) = setup();
    let id = unique_id("tty");
    // `ctr run -t` needs a terminal of its own; `script` provides one.
    let ctr_line = ctd
        .ctr_cmd()
        .args(["run", "-t", "--rm"])
        .args(ctd.run_flags())
        .args([
            image.as_str(),
            id.as_str(),
            "sh",
            "-c", // ctr 1.7's `run -t` may drop the last output of a task that exits at
            // once, hence the sleep.
            "tty; test -t 0 && echo stdin-is-tty; sleep 0.5",
        ])
        .shell_line();
    let out = Cmd::new("script")
        .args(["-q", "-e", "-c", &ctr_line, "/dev/null"])
        .env("TERM", "xterm")
        .stdin_open()
        .run_ok()
        .expect("ctr run -t under script");
    assert!(
        out.stdout.contains("/dev/pts/"),
        "tty inside: {:?}",
        out.stdout
    );
    assert!(out.stdout.contains("stdin-is-tty"), "{:?}", out.stdout);
}

#[test]
fn exec_with_terminal() {
    let (ctd, image) = setup();
    let id = unique_id("exec-tty");
    ctd.run_detached(&id, &image, &gpucr_tests::counter_args())
        .unwrap();
    ctd.wait_status(&id, "RUNNING").unwrap();
    let ctr_line = ctd
        .ctr_cmd()
        .args([
            "task",
            "exec",
            "-t",
            "--exec-id",
            "tty-exec",
            id.as_str(),
            "tty",
        ])
        .shell_line();
    let out = Cmd::new("script")
        .args(["-q", "-e", "-c", &ctr_line, "/dev/null"])
        .stdin_open()
        .run_ok()
        .expect("ctr task exec -t under script");
    assert!(
        out.stdout.contains("/dev/pts/"),
        "exec tty: {:?}",
        out.stdout
    );
    ctd.remove_container(&id).unwrap();
}
