//! `gpucr events`: the node's log of checkpoints and restores as a table (or its JSON lines),
//! and the per-kind summary `gpucr report` prints.

use std::collections::BTreeMap;
use std::path::Path;

use gpucr_store::events::{read_last, Kind, Outcome};
use gpucr_store::StoreError;

use super::bytes;

pub fn print(
    log: &Path,
    last: Option<usize>,
    container: Option<&str>,
    json: bool,
) -> Result<(), StoreError> {
    // With a container, its newest N: the whole log is read and filtered first.
    let (mut events, skipped) = read_last(log, last.filter(|_| container.is_none()))?;
    if let Some(id) = container {
        events.retain(|e| e.container == id);
        let keep = last.unwrap_or(events.len()).min(events.len());
        events.drain(..events.len() - keep);
    }
    if json {
        for e in &events {
            println!("{}", serde_json::to_string(e).expect("an event serialises"));
        }
    } else {
        println!(
            "{:<24} {:<10} {:<6} {:<7} {:>9} {:>10} {:>10} {:<24} ERROR",
            "TIME", "KIND", "RESULT", "MODE", "DURATION", "BYTES", "GPU", "CONTAINER"
        );
        for e in &events {
            println!(
                "{:<24} {:<10} {:<6} {:<7} {:>9} {:>10} {:>10} {:<24} {}",
                e.time,
                e.kind.as_str(),
                e.result.as_str(),
                e.mode,
                duration(e.duration_ms),
                bytes(e.bytes),
                bytes(e.gpu_bytes),
                e.container,
                e.error.as_deref().unwrap_or("-")
            );
        }
    }
    if skipped > 0 {
        eprintln!(
            "gpucr: {skipped} lines of {} are not events (skipped)",
            log.display()
        );
    }
    Ok(())
}

/// `report`'s lines: per kind, how many succeeded and failed, mean duration and bytes.
pub fn summary(log: &Path) -> Result<Vec<String>, StoreError> {
    let (events, _) = read_last(log, None)?;
    #[derive(Default)]
    struct Sum {
        ok: u64,
        failed: u64,
        ms: u64,
        bytes: u64,
        pulled: u64,
    }
    let mut sums: BTreeMap<Kind, Sum> = BTreeMap::new();
    for e in &events {
        let s = sums.entry(e.kind).or_default();
        match e.result {
            Outcome::Ok => {
                s.ok += 1;
                s.ms += e.duration_ms;
                s.bytes += e.bytes;
            }
            Outcome::Error => s.failed += 1,
        }
        s.pulled += e.store_pulled_bytes;
    }
    let mut lines = vec![format!(
        "events:      {} in {}",
        events.len(),
        log.display()
    )];
    for (kind, s) in &sums {
        let mean = s.ms.checked_div(s.ok).map_or("-".into(), duration);
        let mut line = format!(
            "  {:<12} {} ok, {} failed, mean {mean}, {}",
            format!("{}s:", kind.as_str()),
            s.ok,
            s.failed,
            bytes(s.bytes)
        );
        if s.pulled > 0 {
            line += &format!(", {} pulled from the shared store", bytes(s.pulled));
        }
        lines.push(line);
    }
    if let Some(e) = events.iter().rev().find(|e| e.result == Outcome::Error) {
        lines.push(format!(
            "  last error:  {} {} {}: {}",
            e.time,
            e.kind.as_str(),
            e.container,
            e.error.as_deref().unwrap_or("")
        ));
    }
    Ok(lines)
}

fn duration(ms: u64) -> String {
    if ms < 10_000 {
        format!("{:.2}s", ms as f64 / 1000.0)
    } else {
        format!("{:.0}s", ms as f64 / 1000.0)
    }
}
