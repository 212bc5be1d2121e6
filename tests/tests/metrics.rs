//! The node's metrics and event log after a checkpoint, a restore and a failed restore through
//! `ctr`: what a node-exporter textfile collector and an operator reading `events.jsonl` see.

use std::time::Instant;

use gpucr_tests::{containerd::runtime_under_test, unique_id, Containerd};

fn prom_value(prom: &str, series: &str) -> u64 {
    prom.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} not in\n{prom}"))
}

#[test]
fn checkpoint_and_restore_are_counted_and_logged() {
    if !runtime_under_test().contains("gpucr") {
        eprintln!("skipped: metrics are gpucr's");
        return;
    }
    let metrics = tempfile::tempdir().unwrap();
    let ctd =
        Containerd::start_with_env(&[("GPUCR_METRICS_DIR", metrics.path())]).expect("containerd");
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
    let restore_s = t.elapsed().as_secs_f64();

    let prom = std::fs::read_to_string(metrics.path().join("gpucr.prom")).expect("gpucr.prom");
    assert_eq!(
        prom_value(&prom, "gpucr_checkpoints_total{outcome=\"ok\"}"),
        1
    );
    assert_eq!(prom_value(&prom, "gpucr_restores_total{outcome=\"ok\"}"), 1);
    assert_eq!(prom_value(&prom, "gpucr_restore_duration_seconds_count"), 1);
    assert!(
        prom_value(&prom, "gpucr_checkpoint_bytes_total") > 4096,
        "{prom}"
    );
    let log = std::fs::read_to_string(metrics.path().join("events.jsonl")).unwrap();
    let events: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 2, "{log}");
    assert_eq!(events[0]["op"], "checkpoint");
    assert_eq!(events[1]["op"], "restore");
    for e in &events {
        assert_eq!(e["container"], id.as_str());
        assert!(e["error"].is_null(), "{e}");
    }
    let restore_logged = events[1]["seconds"].as_f64().unwrap();
    assert!(
        restore_logged > 0.0 && restore_logged <= restore_s,
        "{restore_logged} vs {restore_s}"
    );
    ctd.remove_container(&id).unwrap();
}
