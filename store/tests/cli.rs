//! The `gpucr` binary on a store the library filled: what an operator sees.

use std::process::Command;

use gpucr_store::events::{self, Event, Kind, Outcome};
use gpucr_store::Store;

fn gpucr(store: &std::path::Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpucr"))
        .arg("--store")
        .arg(store)
        // Not the node's log: none unless a test names one.
        .env(events::EVENT_LOG_ENV, store.join("no-events.jsonl"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn ls_validate_gc_push_pull() {
    let (node_a, node_b, shared) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let store = Store::open(node_a.path()).unwrap();
    for n in 1..=3 {
        let w = store.writer().unwrap();
        let weights = w.put_chunk(&vec![1u8; 1 << 20]).unwrap().chunk;
        let step = w
            .put_chunk(format!("optimizer step {n}").as_bytes())
            .unwrap()
            .chunk;
        w.publish(
            &format!("train/{n}"),
            vec![weights, step],
            serde_json::Value::Null,
        )
        .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
    }

    let (rc, out) = gpucr(node_a.path(), &["ls"]);
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("train/3") && out.contains("1.0 MiB"), "{out}");
    let (rc, out) = gpucr(node_a.path(), &["report"]);
    assert!(rc == 0 && out.contains("sharing:     3.00x"), "{out}");

    let (rc, out) = gpucr(
        node_a.path(),
        &["push", "train/3", "--to", shared.path().to_str().unwrap()],
    );
    assert_eq!(rc, 0, "{out}");
    let (rc, out) = gpucr(
        node_b.path(),
        &["pull", "train/3", "--from", shared.path().to_str().unwrap()],
    );
    assert!(rc == 0 && out.contains("1.0 MiB fetched"), "{out}");
    let (rc, out) = gpucr(node_b.path(), &["validate"]);
    assert!(rc == 0 && out.contains("clean"), "{out}");

    let (rc, out) = gpucr(
        node_a.path(),
        &["gc", "--keep-last", "1", "--pin", "train/1"],
    );
    assert!(rc == 0 && out.contains("removed: train/2"), "{out}");
    let victim = store.manifest("train/3").unwrap().chunks[0];
    std::fs::write(store.chunk_path(&victim.digest), vec![2u8; 1 << 20]).unwrap();
    let (rc, out) = gpucr(node_a.path(), &["validate"]);
    assert_eq!(rc, 1, "{out}");
    assert!(
        out.contains("damaged:") && out.contains(&victim.digest.to_hex()),
        "{out}"
    );
}

#[test]
fn import_then_export_round_trips_a_checkpoint_directory() {
    let (store_dir, ckpt) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let pages: Vec<u8> = (0..(9u32 << 20)).map(|i| (i % 251) as u8).collect();
    std::fs::write(ckpt.path().join("pages-1.img"), &pages).unwrap();
    std::fs::write(ckpt.path().join("inventory.img"), b"inv").unwrap();
    let dir = ckpt.path().to_str().unwrap();
    let (rc, out) = gpucr(store_dir.path(), &["import", dir, "--name", "ctr-1/1"]);
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("imported") && out.contains("1 files"), "{out}");
    assert!(!ckpt.path().join("pages-1.img").exists());
    assert!(ckpt.path().join("gpucr-store.json").exists());
    let (rc, out) = gpucr(store_dir.path(), &["ls"]);
    assert!(rc == 0 && out.contains("ctr-1/1"), "{out}");
    let row = out.lines().find(|l| l.starts_with("ctr-1/1")).unwrap();
    assert!(row.contains("local") && row.contains("node "), "{out}");
    let (rc, out) = gpucr(store_dir.path(), &["export", dir]);
    assert_eq!(rc, 0, "{out}");
    assert_eq!(
        std::fs::read(ckpt.path().join("pages-1.img")).unwrap(),
        pages
    );
    assert!(!ckpt.path().join("gpucr-store.json").exists());
    // Export of a directory whose chunk is gone: refused, the directory unchanged.
    let (rc, out) = gpucr(store_dir.path(), &["import", dir, "--name", "ctr-1/2"]);
    assert_eq!(rc, 0, "{out}");
    let chunks = store_dir.path().join("chunks");
    let sub = std::fs::read_dir(&chunks)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let chunk = std::fs::read_dir(sub)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::remove_file(chunk).unwrap();
    let (rc, out) = gpucr(store_dir.path(), &["export", dir]);
    assert_eq!(rc, 2, "{out}");
    assert!(out.contains("missing"), "{out}");
    assert!(ckpt.path().join("gpucr-store.json").exists());
}

fn event(container: &str, kind: Kind, ms: u64, error: Option<&str>) -> Event {
    let (time, time_unix_ms) = events::timestamp(std::time::SystemTime::now());
    Event {
        time,
        time_unix_ms,
        container: container.into(),
        namespace: "k8s.io".into(),
        kind,
        result: if error.is_some() {
            Outcome::Error
        } else {
            Outcome::Ok
        },
        mode: "shared".into(),
        duration_ms: ms,
        bytes: 3 << 30,
        store_written_bytes: 0,
        store_pushed_bytes: 0,
        store_pulled_bytes: if kind == Kind::Restore { 1 << 30 } else { 0 },
        gpu_bytes: 2 << 30,
        image: "/ckpt".into(),
        error: error.map(str::to_string),
    }
}

#[test]
fn events_and_report_show_the_nodes_checkpoints_and_restores() {
    let (store_dir, logs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let log = logs.path().join("events.jsonl");
    events::append(&log, &event("llm-0", Kind::Checkpoint, 4000, None)).unwrap();
    events::append(&log, &event("llm-0", Kind::Restore, 2000, None)).unwrap();
    let refused = "restore of llm-1 refused: the checkpoint's data is not in this node's store";
    events::append(&log, &event("llm-1", Kind::Restore, 30, Some(refused))).unwrap();
    let log_arg = log.to_str().unwrap();

    let (rc, out) = gpucr(store_dir.path(), &["--event-log", log_arg, "events"]);
    assert_eq!(rc, 0, "{out}");
    let lines: Vec<_> = out.lines().collect();
    assert!(
        lines[0].starts_with("TIME") && lines[0].contains("CONTAINER"),
        "{out}"
    );
    assert_eq!(lines.len(), 4, "{out}");
    assert!(
        lines[1].contains("checkpoint") && lines[1].contains("ok") && lines[1].contains("4.00s"),
        "{out}"
    );
    assert!(
        lines[1].contains("3.0 GiB") && lines[1].contains("2.0 GiB"),
        "{out}"
    );
    assert!(
        lines[3].contains("error") && lines[3].contains(refused),
        "{out}"
    );

    let (rc, out) = gpucr(
        store_dir.path(),
        &["--event-log", log_arg, "events", "--last", "1", "--json"],
    );
    assert_eq!(rc, 0, "{out}");
    let last: Event = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (last.container.as_str(), last.result),
        ("llm-1", Outcome::Error)
    );
    // One container's newest: llm-0's restore, not llm-1's later one.
    let (rc, out) = gpucr(
        store_dir.path(),
        &[
            "--event-log",
            log_arg,
            "events",
            "--container",
            "llm-0",
            "--last",
            "1",
            "--json",
        ],
    );
    assert_eq!(rc, 0, "{out}");
    let last: Event = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (last.container.as_str(), last.kind),
        ("llm-0", Kind::Restore)
    );

    let (rc, out) = gpucr(store_dir.path(), &["--event-log", log_arg, "report"]);
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("events:      3"), "{out}");
    assert!(
        out.contains("checkpoints: 1 ok, 0 failed, mean 4.00s"),
        "{out}"
    );
    assert!(
        out.contains("  restores:    1 ok, 1 failed, mean 2.00s")
            && out.contains("2.0 GiB pulled from the shared store"),
        "{out}"
    );
    assert!(
        out.contains("  last error:") && out.contains("llm-1"),
        "{out}"
    );

    // No log yet: an empty table, not an error.
    let none = logs.path().join("none.jsonl");
    let (rc, out) = gpucr(
        store_dir.path(),
        &["--event-log", none.to_str().unwrap(), "events"],
    );
    assert_eq!((rc, out.lines().count()), (0, 1), "{out}");
}
