//! The staged copy-in through mapped image files; the parent's chunk size.

use super::*;

/// The staged copy-in reads an image on tmpfs through its mapped data files (exact,
/// CRC-checked); with `map_reads` off, or off tmpfs, through `read(2)`.
#[test]
fn staged_copy_in_reads_a_tmpfs_image_through_a_mapping() {
    let Some(root) = tmpfs_dir() else { return };
    let disk = tempfile::tempdir().unwrap();
    // /dev/shm keeps 4 KiB pages unless mounted `huge=` (st_blksize says which).
    let probe = root.path().join("probe");
    std::fs::write(&probe, b"x").unwrap();
    let huge =
        std::os::unix::fs::MetadataExt::blksize(&std::fs::metadata(&probe).unwrap()) >= 2 << 20;
    for (dir, map_reads, want) in [
        (root.path(), MapReads::Tmpfs, true),
        (root.path(), MapReads::HugePages, huge),
        (root.path(), MapReads::Off, false),
        (
            disk.path(),
            MapReads::Tmpfs,
            gpu_state::image::is_tmpfs(disk.path()),
        ),
    ] {
        let s = setup_with(FastPathOptions {
            map_reads,
            ..pipelined()
        });
        let expected = populate_with_duplicates(&s);
        s.fast.freeze().unwrap();
        let image = dir.join(format!("img-{map_reads:?}"));
        s.fast.copy_out(&image, None).unwrap();
        s.fast.release(false).unwrap();
        s.fast.remap().unwrap();
        let report = s.fast.copy_in(&image).unwrap();
        assert_eq!(report.mapped_reads, want, "{dir:?} {map_reads:?}");
        s.fast.thaw().unwrap();
        check_memory(&s.driver, &s.allocator, &expected);

        // A damaged chunk is refused through the mapping too.
        let data = largest_data_file(&image);
        let mut bytes = std::fs::read(&data).unwrap();
        bytes[7] ^= 0x10;
        std::fs::write(&data, bytes).unwrap();
        s.fast.freeze().unwrap();
        s.fast.release(false).unwrap();
        s.fast.remap().unwrap();
        let err = s.fast.copy_in(&image).unwrap_err();
        assert!(
            matches!(err, FastPathError::Image(ImageError::CorruptChunk { .. })),
            "{dir:?}: {err}"
        );
    }
}

/// An incremental copy-out takes its parent's chunk size (written, say, before a change
/// of the default), so unchanged chunks still match and only what changed crosses.
#[test]
fn an_incremental_copy_out_takes_the_parents_chunk_size() {
    let s = with_device_hash(pipelined());
    let mut expected = populate_hashable(&s);
    let root = tempfile::tempdir().unwrap();
    let (full, delta) = (root.path().join("full"), root.path().join("delta"));
    let big = FastPathOptions {
        image: gpu_state::image::ImageOptions {
            chunk_size: 2 * CHUNK,
            ..pipelined().image
        },
        ..pipelined()
    };
    s.fast.freeze().unwrap();
    FastPath::new(s.allocator.clone(), s.gate.clone(), big)
        .copy_out(&full, None)
        .unwrap();
    s.fast.thaw().unwrap();
    let (va, data) = &mut expected[2];
    data[3 * CHUNK + 5] ^= 0xff;
    s.driver.copy_from_host(*va, data).unwrap();
    let changed = (2 * CHUNK).min(data.len() - 2 * CHUNK) as u64;

    s.fast.freeze().unwrap();
    let before = s.driver.host_stats();
    let out = s.fast.copy_out(&delta, Some(&full)).unwrap();
    let moved = s.driver.host_stats().bytes_to_host - before.bytes_to_host;
    let reader = ImageReader::open(&delta).unwrap();
    assert_eq!(reader.manifest().chunk_size, 2 * CHUNK as u64);
    // The changed chunk and the odd-sized allocation (CPU-hashed) cross; nothing else.
    assert_eq!(moved, changed + 4095, "{out:?}");
    assert!(out.parent_chunks > 0, "{out:?}");
    round_trip(&s, &delta, &expected);
}
