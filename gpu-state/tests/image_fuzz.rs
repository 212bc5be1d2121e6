//! The manifest parser never panics: random bytes, byte-level mutations of a real
//! manifest, and JSON-level mutations (extreme numbers, wrong types, removed keys).
//! The same entry point is the cargo-fuzz target in `gpu-state/fuzz`.

mod image_util;

use std::path::Path;

use gpu_state::image::{AllocationTags, Manifest};
use image_util::{small_opts, Rng};

fn sample_manifest() -> Vec<u8> {
    let root = tempfile::tempdir().unwrap();
    let (base, delta) = (root.path().join("base"), root.path().join("delta"));
    let mut rng = Rng(42);
    let data = rng.bytes(3 * (64 << 10) + 11);
    let mut zeros_and_dups = vec![0u8; 2 * (64 << 10)];
    zeros_and_dups.extend_from_slice(&data[..64 << 10]);
    let tags = AllocationTags {
        pid: Some(7),
        device: Some(1),
        labels: [("k".to_string(), "v".to_string())].into(),
    };
    for (dir, parent) in [(&base, None), (&delta, Some(base.as_path()))] {
        let mut writer = gpu_state::ImageWriter::create(dir, parent, small_opts()).unwrap();
        for (va, bytes) in [(0x1000_0000u64, &data), (0x2000_0000, &zeros_and_dups)] {
            let id = writer
                .begin_allocation(va, bytes.len() as u64, tags.clone())
                .unwrap();
            for (i, chunk) in bytes.chunks(64 << 10).enumerate() {
                writer
                    .write_chunk(id, (i * (64 << 10)) as u64, chunk)
                    .unwrap();
            }
        }
        writer.finish().unwrap();
    }
    let bytes = std::fs::read(delta.join("manifest.json")).unwrap();
    Manifest::parse(&bytes, Path::new("sample")).expect("the sample is valid");
    bytes
}

fn parse(bytes: &[u8]) {
    let _ = Manifest::parse(bytes, Path::new("fuzz"));
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(1);
    for _ in 0..3000 {
        let len = rng.below(512) as usize;
        parse(&rng.bytes(len));
    }
}

#[test]
fn mutated_manifests_never_panic() {
    let sample = sample_manifest();
    let mut rng = Rng(2);
    for _ in 0..3000 {
        let mut bytes = sample.clone();
        for _ in 0..=rng.below(4) {
            let at = rng.below(bytes.len() as u64) as usize;
            match rng.below(5) {
                0 => bytes[at] = rng.next() as u8,
                1 => bytes[at] = b"0123456789{}[]\",:-e."[rng.below(20) as usize],
                2 => bytes.truncate(at),
                3 => bytes.insert(at, b"09\"-"[rng.below(4) as usize]),
                _ => {
                    let end = (at + rng.below(64) as usize).min(bytes.len());
                    bytes.drain(at..end);
                }
            }
            if bytes.is_empty() {
                break;
            }
        }
        parse(&bytes);
    }
}

/// Replaces one random number, string or key of the JSON tree.
fn mutate_value(value: &mut serde_json::Value, rng: &mut Rng) {
    use serde_json::Value;
    match value {
        Value::Object(map) if !map.is_empty() => {
            let key = map
                .keys()
                .nth(rng.below(map.len() as u64) as usize)
                .unwrap()
                .clone();
            if rng.below(8) == 0 {
                map.remove(&key);
            } else {
                mutate_value(map.get_mut(&key).unwrap(), rng);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            let i = rng.below(items.len() as u64) as usize;
            match rng.below(8) {
                0 => {
                    items.remove(i);
                }
                1 => {
                    let copy = items[i].clone();
                    items.push(copy);
                }
                _ => mutate_value(&mut items[i], rng),
            }
        }
        other => {
            let extremes = [
                Value::from(0u64),
                Value::from(1u64),
                Value::from(u64::MAX),
                Value::from(u32::MAX as u64 + 1),
                Value::from(-1i64),
                Value::from(1.5f64),
                Value::from("0"),
                Value::from("ffffffffffffffffffffffffffffffff"),
                Value::Null,
                Value::from(Vec::<u8>::new()),
            ];
            *other = extremes[rng.below(extremes.len() as u64) as usize].clone();
        }
    }
}

#[test]
fn structurally_mutated_manifests_never_panic() {
    let sample: serde_json::Value = serde_json::from_slice(&sample_manifest()).unwrap();
    let mut rng = Rng(3);
    let mut accepted = 0;
    for _ in 0..3000 {
        let mut value = sample.clone();
        for _ in 0..=rng.below(3) {
            mutate_value(&mut value, &mut rng);
        }
        let bytes = serde_json::to_vec(&value).unwrap();
        if let Ok(manifest) = Manifest::parse(&bytes, Path::new("fuzz")) {
            let again = Manifest::parse(&manifest.to_json(), Path::new("again")).unwrap();
            assert_eq!(manifest, again);
            accepted += 1;
        }
    }
    // Some mutations are harmless (a label, a tag, a crc value); most must be refused.
    assert!(
        accepted < 2000,
        "{accepted} of 3000 mutated manifests accepted"
    );
}
