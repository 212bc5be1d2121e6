//! GPU state image: damage to data files and manifests is detected with errors that
//! name the file, the allocation and the offset.

mod image_util;

use std::fs::OpenOptions;
use std::path::Path;

use gpu_state::image::{
    Compression, ImageError, ImageOptions, ImageReader, Location, FORMAT_VERSION,
};
use image_util::{alloc, read_back, rewrite_manifest, small_opts, write_image, Rng};

const CHUNK: usize = 64 << 10;
const VA: u64 = 0x7f00_dead_0000;

/// One allocation of three chunks; returns (file name, byte offset) of chunk 1.
fn image_with_chunks(dir: &Path, compression: Compression) -> (String, u64) {
    let data = Rng(21).bytes(3 * CHUNK);
    let manifest = write_image(
        dir,
        None,
        ImageOptions {
            compression,
            ..small_opts()
        },
        &[alloc(VA, data)],
    );
    match manifest.allocations[0].chunks[1].at {
        Location::Data { file, offset, .. } => (manifest.files[file as usize].name.clone(), offset),
        other => panic!("chunk 1 is {other:?}"),
    }
}

fn flip_byte(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn flipped_byte_is_a_crc_error_naming_allocation_offset_and_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let (file, at) = image_with_chunks(&dir, Compression::None);
    flip_byte(&dir.join(&file), at + 100);

    let reader = ImageReader::open(&dir).expect("sizes are intact, so open succeeds");
    let err = read_back(&reader, VA, None).unwrap_err();
    let image_err = err
        .get_ref()
        .and_then(|e| e.downcast_ref::<ImageError>())
        .unwrap();
    let ImageError::CorruptChunk { place, reason, .. } = image_err else {
        panic!("{image_err:?}");
    };
    assert_eq!(
        (place.va, place.offset, place.file_offset),
        (VA, CHUNK as u64, at)
    );
    assert!(reason.contains("CRC32C mismatch"), "{reason}");
    let message = image_err.to_string();
    for needle in [format!("{VA:#x}"), format!("{:#x}", CHUNK), file.clone()] {
        assert!(message.contains(&needle), "{message} lacks {needle}");
    }
    let err = reader.verify(2).unwrap_err();
    assert!(matches!(err, ImageError::CorruptChunk { .. }), "{err}");
}

#[test]
fn flipped_byte_in_a_compressed_chunk_is_detected() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let data: Vec<u8> = (0..3 * CHUNK).map(|i| (i / 7 % 13) as u8).collect();
    let manifest = write_image(&dir, None, small_opts(), &[alloc(VA, data)]);
    let Location::Data {
        file,
        offset,
        stored_len,
        ..
    } = manifest.allocations[0].chunks[2].at
    else {
        panic!("stored");
    };
    flip_byte(
        &dir.join(&manifest.files[file as usize].name),
        offset + stored_len / 2,
    );
    let err = ImageReader::open(&dir).unwrap().verify(1).unwrap_err();
    match err {
        ImageError::CorruptChunk { place, .. } => assert_eq!(place.offset, 2 * CHUNK as u64),
        other => panic!("{other}"),
    }
}

#[test]
fn truncated_data_file_is_refused_at_open() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let (file, at) = image_with_chunks(&dir, Compression::None);
    let data = OpenOptions::new()
        .write(true)
        .open(dir.join(&file))
        .unwrap();
    data.set_len(at + 10).unwrap();
    let err = ImageReader::open(&dir).err().expect("truncation detected");
    let message = err.to_string();
    assert!(matches!(err, ImageError::DataFileSize { .. }), "{err}");
    assert!(message.contains(&file), "{message}");
    assert!(
        message.contains(&format!("allocation {VA:#x}")),
        "{message}"
    );
}

#[test]
fn damaged_manifests_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    image_with_chunks(&dir, Compression::None);
    let manifest_path = dir.join("manifest.json");
    let good = std::fs::read(&manifest_path).unwrap();

    // A digit changed: still JSON, but the checksum catches it.
    let mut bytes = good.clone();
    let digit = bytes
        .iter()
        .rposition(|b| b.is_ascii_digit() && *b != b'9')
        .unwrap();
    bytes[digit] += 1;
    std::fs::write(&manifest_path, &bytes).unwrap();
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(matches!(err, ImageError::BadManifest { .. }), "{err}");

    // Cut short: not JSON.
    std::fs::write(&manifest_path, &good[..good.len() / 2]).unwrap();
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(matches!(err, ImageError::BadManifest { .. }), "{err}");
    assert!(err.to_string().contains("manifest.json"), "{err}");

    // Checksum matches but the structure is wrong: chunk 1 claims the wrong offset.
    std::fs::write(&manifest_path, &good).unwrap();
    rewrite_manifest(&dir, |m| {
        m["allocations"][0]["chunks"][1]["offset"] = 5.into()
    });
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(err.to_string().contains("chunk 1"), "{err}");

    // Stored range outside its data file.
    std::fs::write(&manifest_path, &good).unwrap();
    rewrite_manifest(&dir, |m| {
        m["allocations"][0]["chunks"][2]["at"]["data"]["offset"] = u64::MAX.into()
    });
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(matches!(err, ImageError::BadManifest { .. }), "{err}");

    // No checksum file.
    std::fs::write(&manifest_path, &good).unwrap();
    std::fs::remove_file(dir.join("manifest.blake3")).unwrap();
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(err.to_string().contains("manifest.blake3"), "{err}");
}

#[test]
fn newer_format_version_is_named() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    image_with_chunks(&dir, Compression::None);
    rewrite_manifest(&dir, |m| {
        m["version"] = (FORMAT_VERSION + 1).into();
        m["allocations"] = "a shape this version does not know".into();
    });
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(
        matches!(
            err,
            ImageError::UnsupportedVersion {
                found,
                supported: FORMAT_VERSION,
                ..
            } if found == FORMAT_VERSION + 1
        ),
        "{err}"
    );
    assert!(err.to_string().contains("upgrade"), "{err}");

    rewrite_manifest(&dir, |m| m["format"] = "something-else".into());
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(matches!(err, ImageError::BadManifest { .. }), "{err}");
}
