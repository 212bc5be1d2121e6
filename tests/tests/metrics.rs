//! The node's metrics and event log after checkpoints, a restore and a failed restore through
//! `ctr`: what node-exporter's textfile collector and an operator running `gpucr events` see.
//! The textfile and the log are where `GPUCR_METRICS_TEXTFILE` and `GPUCR_EVENT_LOG` in
//! containerd's environment put them.

use std::path::Path;
use std::time::Instant;

use gpucr_tests::{containerd::runtime_under_test, unique_id, Containerd};

/// The value of `series` (the whole series, labels included) in the textfile.
fn prom_value(prom: &str, series: &str) -> f64 {
    prom.lines()
        .find_map(|l| {
            let (s, v) = l.rsplit_once(' ')?;
            (s == series).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or_else(|| panic!("{series} not in\n{prom}"))
}

fn events(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_else(|e| panic!("{}: {e}", log.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The installed `gpucr` CLI.
fn gpucr(args: &[&str]) -> String {
    let bin = gpucr_tests::shim_dir().unwrap().join("gpucr");
    let out = std::process::Command::new(&bin)
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gpucr {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn checkpoint_and_restore_are_counted_and_logged() {
    if !runtime_under_test().contains("gpucr") {
        eprintln!("skipped: metrics are gpucr's");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let textfile = dir.path().join("textfile/gpucr.prom");
    let log = dir.path().join("log/events.jsonl");
    let ctd = Containerd::start_with_env(&[
        ("GPUCR_METRICS_TEXTFILE", textfile.as_os_str()),
        ("GPUCR_EVENT_LOG", log.as_os_str()),
    ])
    .expect("containerd");
    let image = ctd.import_busybox().expect("busybox");
    let id = unique_id("metrics");
    ctd.run_counter(&id, &image).unwrap();
    ctd.wait_counter_above(&id, 3).unwrap();
    let checkpoint = ctd
        .task_checkpoint(&id, &[])
        .expect("ctr task checkpoint")
        .expect("checkpoint image");
    ctd.remove_container(&id).unwrap();
    let t = Instant::now();
    ctd.restore_task_checkpoint(&id, &checkpoint, true)
        .expect("restore");
    ctd.wait_status(&id, "RUNNING").unwrap();
    let restore_ms = t.elapsed().as_millis() as u64;

    // A damaged image: its restore fails at Create and is counted as an error.
    let spec = ctd.container_spec(&id).unwrap();
    let image_path = ctd.dir().join("ck-damaged");
    ctd.checkpoint_into(&id, &image_path).unwrap();
    ctd.remove_container(&id).unwrap();
    let pages = std::fs::read_dir(&image_path)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("pages-"))
        .expect("CRIU's pages")
        .path();
    let mut bytes = std::fs::read(&pages).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&pages, bytes).unwrap();
    ctd.restore_from_image_path(&id, &image_path, &image, &spec)
        .expect_err("a damaged image is refused");

    let prom = std::fs::read_to_string(&textfile).expect("the textfile");
    let v = |s: &str| prom_value(&prom, s);
    assert_eq!(
        v("gpucr_checkpoints_total{mode=\"inline\",result=\"ok\"}"),
        2.0
    );
    assert_eq!(
        v("gpucr_restores_total{mode=\"inline\",result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        v("gpucr_restores_total{mode=\"inline\",result=\"error\"}"),
        1.0
    );
    assert_eq!(
        v("gpucr_restore_duration_seconds_count{mode=\"inline\"}"),
        1.0
    );
    assert!(
        v("gpucr_checkpoint_bytes_total{mode=\"inline\"}") > 4096.0,
        "{prom}"
    );
    assert!(prom.contains("# TYPE gpucr_checkpoint_duration_seconds histogram"));

    let events = events(&log);
    assert_eq!(events.len(), 4, "{events:?}");
    let kinds: Vec<_> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["checkpoint", "restore", "checkpoint", "restore"]);
    for e in &events {
        assert_eq!(e["container"], id.as_str());
        assert_eq!(e["mode"], "inline");
        assert!(e["time"].as_str().unwrap().ends_with('Z'), "{e}");
    }
    assert_eq!(events[1]["result"], "ok");
    let logged = events[1]["duration_ms"].as_u64().unwrap();
    assert!(
        logged > 0 && logged <= restore_ms,
        "{logged} vs {restore_ms}"
    );
    assert_eq!(events[3]["result"], "error");
    assert!(
        events[3]["error"].as_str().is_some_and(|m| !m.is_empty()),
        "{}",
        events[3]
    );

    let log_arg = log.to_str().unwrap();
    let table = gpucr(&["--event-log", log_arg, "events", "--last", "2"]);
    let rows: Vec<_> = table.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(
        rows[1].contains("restore") && rows[1].contains("error"),
        "{table}"
    );
    let store = dir.path().join("store");
    let report = gpucr(&[
        "--store",
        store.to_str().unwrap(),
        "--event-log",
        log_arg,
        "report",
    ]);
    assert!(report.contains("1 ok, 1 failed"), "{report}");
}
