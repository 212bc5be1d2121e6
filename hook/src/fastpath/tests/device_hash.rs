//! Chunk digests computed on the device: skipped chunks, incremental images, the device check.

use super::*;

fn gpu_hashed_chunks(dir: &Path) -> (usize, usize) {
    let reader = ImageReader::open(dir).unwrap();
    let chunks = reader.allocations().iter().flat_map(|a| &a.chunks);
    chunks.fold((0, 0), |(g, b), c| {
        (
            g + c.gpu_hash.is_some() as usize,
            b + c.blake3.is_some() as usize,
        )
    })
}

#[test]
fn device_hash_skips_zero_chunks_and_restores_exactly() {
    let s = with_device_hash(pipelined());
    let expected = populate_hashable(&s);
    let total: u64 = expected.iter().map(|(_, d)| d.len() as u64).sum();
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    let before = s.driver.host_stats();
    let out = s.fast.copy_out(&image, None).unwrap();
    let st = s.driver.host_stats();
    assert_eq!(st.device_hashes - before.device_hashes, 1, "one hash call");
    // The zero stretch of each patterned allocation (chunk 1) and the zero allocation.
    assert_eq!(out.zero_chunks, 2 + 2, "{out:?}");
    assert_eq!(out.parent_chunks, 0);
    assert_eq!(out.bytes, total);
    assert_eq!(out.copied_bytes, total - 4 * CHUNK as u64, "{out:?}");
    assert_eq!(st.bytes_to_host - before.bytes_to_host, out.copied_bytes);
    let (gpu, cpu) = gpu_hashed_chunks(&image);
    assert!(gpu > 0, "chunks carry gh1 digests");
    assert_eq!(cpu, 1, "the odd-sized allocation is hashed on the CPU");
    round_trip(&s, &image, &expected);
}

#[test]
fn device_hash_incremental_copies_only_what_changed() {
    let s = with_device_hash(pipelined());
    let mut expected = populate_hashable(&s);
    // One byte of one chunk of the big allocation changes.
    let (_root, full, delta) = full_image_then_change(&s, &mut expected, 2, 3 * CHUNK + 5);
    let before = s.driver.host_stats();
    let out = s.fast.copy_out(&delta, Some(&full)).unwrap();
    let moved = s.driver.host_stats().bytes_to_host - before.bytes_to_host;
    // The changed chunk and the odd-sized allocation (CPU-hashed) cross; nothing else.
    assert_eq!(moved, CHUNK as u64 + 4095, "{out:?}");
    assert_eq!(out.copied_bytes, moved);
    assert!(out.parent_chunks > 0);
    round_trip(&s, &delta, &expected);
}

#[test]
fn a_failed_device_hash_falls_back_to_the_cpu() {
    let s = with_device_hash(pipelined());
    let expected = populate_hashable(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.driver.fail_next(DriverCall::Hash);
    s.fast.freeze().unwrap();
    let out = s.fast.copy_out(&image, None).unwrap();
    assert_eq!(out.copied_bytes, out.bytes, "everything copied");
    assert_eq!((out.zero_chunks, out.parent_chunks), (0, 0));
    assert_eq!(gpu_hashed_chunks(&image).0, 0, "BLAKE3 only");
    round_trip(&s, &image, &expected);
}

#[test]
fn device_hash_with_direct_copy_out_leaves_skipped_chunks_no_place() {
    let Some(root) = tmpfs_dir() else { return };
    let s = with_device_hash(direct());
    let expected = populate_hashable(&s);
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    let out = s.fast.copy_out(&image, None).unwrap();
    assert_eq!(out.zero_chunks, 4);
    let (blocks, _) = data_usage(&image);
    assert!(
        blocks <= out.copied_bytes + 16 * 4096,
        "{blocks} for {out:?}"
    );
    round_trip(&s, &image, &expected);
}

/// Flips one byte of the first stored chunk of `image` (a raw data file).
fn damage_first_stored_chunk(image: &Path) -> u64 {
    use gpu_state::image::Location;
    let reader = ImageReader::open(image).unwrap();
    let (va, file, offset) = reader
        .allocations()
        .iter()
        .find_map(|a| {
            a.chunks.iter().find_map(|c| match c.at {
                Location::Data { file, offset, .. } if c.gpu_hash.is_some() => {
                    Some((a.va, file, offset))
                }
                _ => None,
            })
        })
        .expect("a gh1 chunk");
    let path = image.join(&reader.manifest().files[file as usize].name);
    drop(reader);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[offset as usize + 3] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    va
}

#[test]
fn copy_in_checks_gpu_hashed_chunks_on_the_device() {
    let s = with_device_hash(pipelined());
    let expected = populate_hashable(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    s.fast.copy_out(&image, None).unwrap();
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    let before = s.driver.host_stats().device_hashes;
    let rep = s.fast.copy_in(&image).unwrap();
    // One probe and one check.
    assert_eq!(s.driver.host_stats().device_hashes - before, 2, "{rep:?}");
    s.fast.thaw().unwrap();
    check(&s, &expected);

    // A damaged chunk: the CPU no longer CRCs it, the device check catches it.
    let err = damaged_copy_in_fails_the_device_check(&s, &image);
    assert!(
        err.to_string().contains("does not match the gh1 digest"),
        "{err}"
    );
}

/// Damages `image`, then releases, remaps and copies it in again (from Running): the
/// copy-in must fail the device check at the damaged allocation. Returns the error.
fn damaged_copy_in_fails_the_device_check(s: &Setup, image: &Path) -> FastPathError {
    let va = damage_first_stored_chunk(image);
    s.fast.freeze().unwrap();
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    let err = s.fast.copy_in(image).unwrap_err();
    assert!(
        matches!(err, FastPathError::DeviceCheck { va: v, .. } if v == va),
        "{err}"
    );
    err
}

#[test]
fn without_the_device_hash_copy_in_checks_crc_on_the_cpu() {
    let s = with_device_hash(pipelined());
    populate_hashable(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    s.fast.copy_out(&image, None).unwrap();
    damage_first_stored_chunk(&image);
    s.driver.set_device_hash(false);
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    let err = s.fast.copy_in(&image).unwrap_err();
    assert!(err.to_string().contains("CRC32C mismatch"), "{err}");
}

#[test]
fn direct_copy_in_defers_gpu_hashed_chunks_to_the_device_check() {
    let Some(root) = tmpfs_dir() else { return };
    let s = with_device_hash(direct());
    let expected = populate_hashable(&s);
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    s.fast.copy_out(&image, None).unwrap();
    round_trip(&s, &image, &expected);
    damaged_copy_in_fails_the_device_check(&s, &image);
}
