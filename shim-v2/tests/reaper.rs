//! The reaper in a test process of its own: its `waitpid(-1)` takes every child of the
//! process, so it must not share one with other tests that spawn children. One test.

use std::process::Command;
use std::time::Duration;

use gpucr_shim::reaper::{Reaper, Spawner};
use nix::unistd::Pid;

#[tokio::test]
async fn commands_and_orphans_are_reaped_once() {
    let (reaper, mut exits) = Reaper::start().unwrap();
    let sp = Spawner::Reaped(reaper.clone());
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
    let out = sp.output(cmd).await.unwrap();
    assert_eq!(out.status, 3);
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");

    // A child nobody awaits goes to the exit stream, with 128+signal when killed.
    // Reaped by the reaper under test, not by std: hence no wait().
    #[allow(clippy::zombie_processes)]
    let child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id() as i32;
    nix::sys::signal::kill(Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let exit = tokio::time::timeout(std::time::Duration::from_secs(5), exits.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(exit.pid, pid);
    assert_eq!(exit.status, 137);

    // One reaper per test process (a second one would take this one's children): the
    // deadline's case runs in the same test.
    deadline_kills_the_command_and_its_children(&sp).await;
}

async fn deadline_kills_the_command_and_its_children(sp: &Spawner) {
    let marker = tempfile::NamedTempFile::new().unwrap();
    // The child records its pid; both would outlive the test without the kill.
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        &format!(
            "sh -c 'echo $$ > {}; exec sleep 600' & wait",
            marker.path().display()
        ),
    ]);
    let t0 = std::time::Instant::now();
    let err = sp
        .output_within(cmd, Some(Duration::from_millis(500)))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    let child: i32 = std::fs::read_to_string(marker.path())
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Killed (a zombie until the test's reaper collects it, then gone).
    let alive = || {
        std::fs::read_to_string(format!("/proc/{child}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
    };
    for _ in 0..50 {
        if !alive() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !alive(),
        "the command's child {child} survived its deadline"
    );
    // Within its deadline the same call just answers.
    let mut ok = Command::new("true");
    ok.arg("x");
    let out = sp
        .output_within(ok, Some(Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(out.status, 0);
}
