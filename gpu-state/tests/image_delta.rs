//! GPU state image: delta images against a parent chain.

mod image_util;

use gpu_state::image::{ImageError, ImageOptions, ImageReader, ImageWriter};
use image_util::{alloc, read_back, rewrite_manifest, small_opts, write_image, Alloc, Rng};

const CHUNK: usize = 64 << 10;

fn weights() -> Vec<Alloc> {
    let mut rng = Rng(99);
    vec![
        alloc(0x7f00_0000_0000, rng.bytes(6 * CHUNK + 300)),
        alloc(0x7f00_1000_0000, rng.bytes(2 * CHUNK)),
        alloc(0x7f00_2000_0000, vec![0; 3 * CHUNK]),
    ]
}

fn assert_reads(reader: &ImageReader, allocs: &[Alloc]) {
    for a in allocs {
        assert_eq!(
            read_back(reader, a.va, None).unwrap(),
            a.data,
            "allocation {:#x}",
            a.va
        );
    }
}

#[test]
fn unchanged_memory_stores_nothing_and_a_changed_chunk_is_stored() {
    let root = tempfile::tempdir().unwrap();
    let (base, same, changed) = (
        root.path().join("1"),
        root.path().join("2"),
        root.path().join("3"),
    );
    let mut allocs = weights();
    write_image(&base, None, small_opts(), &allocs);

    write_image(&same, Some(&base), small_opts(), &allocs);
    let reader = ImageReader::open(&same).unwrap();
    let summary = reader.verify(2).unwrap();
    assert_eq!(summary.stored_bytes, 0, "{summary}");
    assert_eq!(summary.parent_bytes, 8 * CHUNK as u64 + 300);
    assert_eq!(summary.chain_depth, 1);
    assert_reads(&reader, &allocs);

    allocs[0].data[3 * CHUNK + 5] ^= 0xff;
    allocs[1].data[CHUNK..].fill(7);
    write_image(&changed, Some(&same), small_opts(), &allocs);
    let reader = ImageReader::open(&changed).unwrap();
    let summary = reader.verify(2).unwrap();
    assert_eq!(summary.unique_bytes, 2 * CHUNK as u64, "{summary}");
    assert_eq!(summary.chain_depth, 2);
    assert_eq!(reader.chain().len(), 3);
    assert_reads(&reader, &allocs);
}

#[test]
fn chain_moves_as_a_whole_and_parent_can_be_given_explicitly() {
    let root = tempfile::tempdir().unwrap();
    let first = root.path().join("a");
    std::fs::create_dir(&first).unwrap();
    let (base, delta) = (first.join("base"), first.join("delta"));
    let allocs = weights();
    write_image(&base, None, small_opts(), &allocs);
    write_image(&delta, Some(&base), small_opts(), &allocs);

    let moved = root.path().join("b");
    std::fs::rename(&first, &moved).unwrap();
    assert_reads(&ImageReader::open(&moved.join("delta")).unwrap(), &allocs);

    let elsewhere = root.path().join("base-elsewhere");
    std::fs::rename(moved.join("base"), &elsewhere).unwrap();
    let err = ImageReader::open(&moved.join("delta")).err().unwrap();
    assert!(matches!(err, ImageError::ParentMissing { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("base") && message.contains("missing"),
        "{message}"
    );
    let reader = ImageReader::open_with_parent(&moved.join("delta"), &elsewhere).unwrap();
    assert_reads(&reader, &allocs);
}

#[test]
fn a_replaced_or_altered_parent_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let (base, delta, other) = (
        root.path().join("base"),
        root.path().join("delta"),
        root.path().join("other"),
    );
    let allocs = weights();
    write_image(&base, None, small_opts(), &allocs);
    write_image(&delta, Some(&base), small_opts(), &allocs);

    // Another image with the same content at the parent's path: another id.
    write_image(&other, None, small_opts(), &allocs);
    std::fs::rename(&base, root.path().join("old-base")).unwrap();
    std::fs::rename(&other, &base).unwrap();
    let err = ImageReader::open(&delta).err().unwrap();
    assert!(matches!(err, ImageError::ParentChanged { .. }), "{err}");
    assert!(err.to_string().contains("its id is"), "{err}");

    // The real parent with a rewritten (still self-consistent) manifest.
    std::fs::remove_dir_all(&base).unwrap();
    std::fs::rename(root.path().join("old-base"), &base).unwrap();
    rewrite_manifest(&base, |m| m["allocations"][0]["tags"]["pid"] = 1.into());
    let err = ImageReader::open(&delta).err().unwrap();
    assert!(
        err.to_string().contains("manifest checksum differs"),
        "{err}"
    );
}

#[test]
fn writing_against_a_missing_or_incomplete_parent_fails() {
    let root = tempfile::tempdir().unwrap();
    let missing = root.path().join("nope");
    let err = ImageWriter::create(&root.path().join("x"), Some(&missing), small_opts())
        .err()
        .unwrap();
    assert!(err.to_string().contains("nope"), "{err}");
    let empty = root.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = ImageWriter::create(&root.path().join("x"), Some(&empty), small_opts())
        .err()
        .unwrap();
    assert!(matches!(err, ImageError::Incomplete { .. }), "{err}");
    assert!(!root.path().join("x").exists());
}

/// An incremental image takes its parent's chunk size (chunks of another size never
/// match), with the staging pool's bytes kept.
#[test]
fn an_incremental_image_takes_its_parents_chunk_size() {
    let root = tempfile::tempdir().unwrap();
    let (base, next) = (root.path().join("1"), root.path().join("2"));
    let allocs = weights();
    write_image(&base, None, small_opts(), &allocs);
    let half = ImageOptions {
        chunk_size: CHUNK / 2,
        max_in_flight: 8,
        ..small_opts()
    };
    let writer = ImageWriter::create(&next, Some(&base), half).unwrap();
    assert_eq!(writer.chunk_size(), CHUNK);
    assert_eq!(writer.options().max_in_flight, 4, "the same pool bytes");
    drop(writer);
    let _ = std::fs::remove_dir_all(&next);
    write_image(&next, Some(&base), half, &allocs);
    let reader = ImageReader::open(&next).unwrap();
    assert_eq!(reader.manifest().chunk_size, CHUNK as u64);
    let summary = reader.verify(2).unwrap();
    assert_eq!(
        summary.stored_bytes, 0,
        "everything from the parent: {summary}"
    );
    assert_reads(&reader, &allocs);
    // Without a parent the given size holds.
    let own = root.path().join("3");
    write_image(&own, None, half, &allocs);
    assert_eq!(
        ImageReader::open(&own).unwrap().manifest().chunk_size,
        (CHUNK / 2) as u64
    );
}
