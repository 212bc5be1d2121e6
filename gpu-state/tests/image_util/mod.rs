//! Helpers shared by the image_* tests: a seeded generator and small write/read calls.
#![allow(dead_code)]

use std::io::Read;
use std::path::Path;

use gpu_state::image::{
    AllocationTags, Compression, ImageOptions, ImageReader, ImageWriter, Manifest,
};

/// xorshift64*: reproducible test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// Small chunks so tests cover many chunks with little data.
pub fn small_opts() -> ImageOptions {
    ImageOptions {
        chunk_size: 64 << 10,
        compression: Compression::Zstd { level: 3 },
        threads: 3,
        max_in_flight: 4,
        align: 0,
    }
}

pub struct Alloc {
    pub va: u64,
    pub data: Vec<u8>,
    pub tags: AllocationTags,
}

pub fn alloc(va: u64, data: Vec<u8>) -> Alloc {
    Alloc {
        va,
        data,
        tags: AllocationTags::default(),
    }
}

/// Writes `allocs` chunk by chunk with `write_chunk` and finishes the image.
pub fn write_image(
    dir: &Path,
    parent: Option<&Path>,
    opts: ImageOptions,
    allocs: &[Alloc],
) -> Manifest {
    let mut writer = ImageWriter::create(dir, parent, opts).expect("create");
    for a in allocs {
        let id = writer
            .begin_allocation(a.va, a.data.len() as u64, a.tags.clone())
            .expect("begin");
        // The writer's chunk size: with a parent, the parent's.
        let size = writer.chunk_size();
        for (i, chunk) in a.data.chunks(size).enumerate() {
            writer
                .write_chunk(id, (i * size) as u64, chunk)
                .expect("write chunk");
        }
    }
    writer.finish().expect("finish")
}

/// Reads an allocation back through `read_allocation` (the `Read` path).
pub fn read_back(reader: &ImageReader, va: u64, pid: Option<u32>) -> std::io::Result<Vec<u8>> {
    let id = reader.find(va, pid).expect("allocation present");
    let mut out = Vec::new();
    reader
        .read_allocation(id)
        .expect("reader")
        .read_to_end(&mut out)?;
    Ok(out)
}

/// Rewrites manifest.json with `edit` applied to its JSON and a matching checksum,
/// as a tool (or an attacker) that knows the format would.
pub fn rewrite_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut value: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut value);
    let bytes = serde_json::to_vec(&value).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    let sum = blake3_hex(&bytes);
    std::fs::write(dir.join("manifest.blake3"), format!("{sum}\n")).unwrap();
}

pub fn blake3_hex(bytes: &[u8]) -> String {
    gpu_state::image::ContentHash::of(bytes).to_hex()
}

/// The largest data file (`*.bin`) of an image, e.g. to damage it: a file one worker
/// wrote a short chunk to can be a few bytes long, and `read_dir`'s order is not fixed.
pub fn largest_data_file(dir: &Path) -> std::path::PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".bin"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("the image has a data file")
}
