//! GPU state image: chunks whose identity is known before the copy (gh1 digests from the
//! GPU, here from the CPU reference): zero and parent-stored chunks are never written,
//! the rest are stored with their digest, and everything reads back exact.

mod image_util;

use gpu_state::image::gpuhash;
use gpu_state::image::{
    AllocationTags, ChunkKey, Compression, ImageOptions, ImageReader, ImageWriter, Location,
    Manifest, FORMAT_VERSION, FORMAT_VERSION_BLAKE3_ONLY,
};
use image_util::{read_back, rewrite_manifest, Rng};

const CHUNK: usize = 64 << 10;

fn opts() -> ImageOptions {
    ImageOptions {
        chunk_size: CHUNK,
        compression: Compression::None,
        threads: 3,
        max_in_flight: 4,
        align: 0,
    }
}

/// Writes one allocation as the hook does with GPU digests: resolve every chunk first,
/// then copy (stage + commit) only those that need it. Returns the manifest and how many
/// chunks were copied.
fn write_resolved(
    dir: &std::path::Path,
    parent: Option<&std::path::Path>,
    va: u64,
    data: &[u8],
) -> (Manifest, usize) {
    let mut w = ImageWriter::create(dir, parent, opts()).unwrap();
    let id = w
        .begin_allocation(va, data.len() as u64, AllocationTags::default())
        .unwrap();
    let mut need = Vec::new();
    for (i, chunk) in data.chunks(CHUNK).enumerate() {
        let offset = (i * CHUNK) as u64;
        if w.resolve(id, offset, gpuhash::digest(chunk).unwrap())
            .unwrap()
        {
            need.push((offset, chunk));
        }
    }
    let copied = need.len();
    for (offset, chunk) in need {
        let mut staged = w.stage(id, offset).unwrap();
        staged.data_mut().copy_from_slice(chunk);
        w.commit(staged).unwrap();
    }
    (w.finish().unwrap(), copied)
}

fn weights_and_activations(rng: &mut Rng) -> Vec<u8> {
    let mut data = rng.bytes(8 * CHUNK);
    data[2 * CHUNK..3 * CHUNK].fill(0);
    // Two equal chunks: stored once.
    let (a, b) = data.split_at_mut(6 * CHUNK);
    b[..CHUNK].copy_from_slice(&a[5 * CHUNK..6 * CHUNK]);
    data
}

#[test]
fn resolved_chunks_round_trip_and_zero_chunks_are_never_copied() {
    let tmp = tempfile::tempdir().unwrap();
    let data = weights_and_activations(&mut Rng(3));
    let (m, copied) = write_resolved(&tmp.path().join("img"), None, 0x7000_0000, &data);
    assert_eq!(copied, 7, "the zero chunk needs no copy");
    assert_eq!(m.version, FORMAT_VERSION);
    let chunks = &m.allocations[0].chunks;
    assert_eq!(chunks[2].at, Location::Zero);
    assert!(chunks[2].gpu_hash.is_none() && chunks[2].crc32c.is_none());
    for (i, c) in chunks.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert!(c.gpu_hash.is_some() && c.blake3.is_none(), "chunk {i}");
        assert!(matches!(c.key(), Some(ChunkKey::Gpu(_))));
    }
    assert_eq!(chunks[5].at, chunks[6].at, "equal chunks share one place");
    let reader = ImageReader::open(&tmp.path().join("img")).unwrap();
    reader.verify(2).unwrap();
    assert_eq!(read_back(&reader, 0x7000_0000, None).unwrap(), data);
}

#[test]
fn unchanged_chunks_come_from_the_parent_without_a_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = Rng(5);
    let data = weights_and_activations(&mut rng);
    let parent = tmp.path().join("full");
    write_resolved(&parent, None, 0x7000_0000, &data);
    let mut changed = data.clone();
    changed[7 * CHUNK..].copy_from_slice(&rng.bytes(CHUNK));
    let (m, copied) = write_resolved(
        &tmp.path().join("delta"),
        Some(&parent),
        0x7000_0000,
        &changed,
    );
    assert_eq!(copied, 1, "only the changed chunk crosses");
    let parents = m.allocations[0]
        .chunks
        .iter()
        .filter(|c| matches!(c.at, Location::Parent { .. }))
        .count();
    assert_eq!(parents, 6);
    let reader = ImageReader::open(&tmp.path().join("delta")).unwrap();
    reader.verify(2).unwrap();
    assert_eq!(read_back(&reader, 0x7000_0000, None).unwrap(), changed);
}

#[test]
fn a_cpu_hashed_parent_gives_no_matches_but_a_correct_image() {
    let tmp = tempfile::tempdir().unwrap();
    let data = weights_and_activations(&mut Rng(8));
    let parent = tmp.path().join("cpu");
    let m = image_util::write_image(
        &parent,
        None,
        opts(),
        &[image_util::alloc(0x7000_0000, data.clone())],
    );
    assert_eq!(
        m.version, FORMAT_VERSION_BLAKE3_ONLY,
        "no gh1: readable by format-1 readers"
    );
    let (_, copied) = write_resolved(&tmp.path().join("gpu"), Some(&parent), 0x7000_0000, &data);
    assert_eq!(copied, 7, "BLAKE3 and gh1 keys never match");
    let reader = ImageReader::open(&tmp.path().join("gpu")).unwrap();
    assert_eq!(read_back(&reader, 0x7000_0000, None).unwrap(), data);
}

#[test]
fn gh1_digests_in_a_version_1_manifest_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("img");
    write_resolved(
        &dir,
        None,
        0x7000_0000,
        &weights_and_activations(&mut Rng(9)),
    );
    rewrite_manifest(&dir, |v| v["version"] = 1.into());
    let err = ImageReader::open(&dir).err().expect("refused");
    assert!(
        err.to_string().contains("gpu_hash in a version 1 manifest"),
        "{err}"
    );
}
