//! The checkpoint manifest's cost, for docs/BENCHMARKS.md: `verify-image seal DIR` writes
//! `gpucr-checkpoint.json` for the image in DIR as a checkpoint does; `verify-image check DIR`
//! runs the restore's check of it. Each prints the bytes, the time and the rate.

use std::{path::PathBuf, time::Instant};

use gpucr_shim::manifest;

fn main() {
    let mut args = std::env::args().skip(1);
    let (verb, dir) = match (args.next(), args.next()) {
        (Some(v), Some(d)) => (v, PathBuf::from(d)),
        _ => {
            eprintln!("usage: verify-image seal|check DIR");
            std::process::exit(2);
        }
    };
    let bytes = manifest::image_bytes(&dir);
    let started = Instant::now();
    let res = match verb.as_str() {
        "seal" => manifest::write_manifest("bench", &dir, true, 0),
        "check" => manifest::validate_image("bench", &dir),
        other => {
            eprintln!("unknown verb {other:?}: seal or check");
            std::process::exit(2);
        }
    };
    let secs = started.elapsed().as_secs_f64();
    if let Err(e) = res {
        eprintln!("{verb}: {e}");
        std::process::exit(1);
    }
    println!(
        "{verb}: {bytes} bytes in {secs:.3} s = {:.2} GB/s on {} threads",
        bytes as f64 / secs / 1e9,
        manifest::hash_threads()
    );
}
