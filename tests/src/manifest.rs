//! gpucr's checkpoint manifest (`gpucr-checkpoint.json`) from the tests' side: rewriting a
//! file of an image together with its manifest entry, as if the checkpoint had written it so,
//! to reach the checks behind the manifest's (the hook's own chunk hashes, the GPU record).

use std::path::Path;

use serde_json::Value;

/// The shim's chunk size for a manifest's BLAKE3 hashes (version 2).
pub const CHUNK_SIZE: usize = 8 << 20;

/// The manifest's entry for `data`, in the form the old one had: chunk hashes (version 2),
/// an FNV-1a checksum (version 1), or the size alone (a file the hook checks itself).
fn entry_like(old: &Value, data: &[u8]) -> Value {
    let mut entry = serde_json::json!({ "size": data.len() });
    if old.get("blake3").is_some() {
        let chunks: Vec<String> = data
            .chunks(CHUNK_SIZE)
            .map(|c| blake3::hash(c).to_hex().to_string())
            .collect();
        entry["blake3"] = chunks.into();
    }
    if old.get("fnv1a64").is_some() {
        entry["fnv1a64"] = fnv1a64(data).into();
    }
    entry
}

fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// Writes `data` as `name` in image `dir` and updates its manifest entry to match.
pub fn rewrite_with_manifest(dir: &Path, name: &str, data: &[u8]) {
    std::fs::write(dir.join(name), data).unwrap();
    let path = dir.join("gpucr-checkpoint.json");
    let mut manifest: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let new = entry_like(&manifest["files"][name], data);
    manifest["files"][name] = new;
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
}
