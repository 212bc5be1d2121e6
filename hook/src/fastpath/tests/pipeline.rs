//! Pipelined staged copies: exact, pinned once, every DMA waited for.

use super::*;

/// Chunk records that must not depend on how chunks reached the writer.
/// (offset, len, crc32c) of one chunk.
type ChunkRecord = (u64, u64, Option<u32>);

fn chunk_list(dir: &Path) -> Vec<(u64, Vec<ChunkRecord>)> {
    let reader = ImageReader::open(dir).unwrap();
    reader
        .allocations()
        .iter()
        .map(|a| {
            let c = a
                .chunks
                .iter()
                .map(|c| (c.offset, c.len, c.crc32c))
                .collect();
            (a.va, c)
        })
        .collect()
}

#[test]
fn pipelined_copies_are_exact_pinned_once_and_fully_waited_for() {
    let s = setup_with(pipelined());
    let expected = populate(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");

    // The same contents written one chunk at a time, for comparison.
    let reference = root.path().join("ref");
    let mut writer = ImageWriter::create(&reference, None, pipelined().image).unwrap();
    for (va, data) in &expected {
        let id = writer
            .begin_allocation(*va, data.len() as u64, s.fast.tags())
            .unwrap();
        for (i, c) in data.chunks(CHUNK).enumerate() {
            writer.write_chunk(id, (i * CHUNK) as u64, c).unwrap();
        }
    }
    writer.finish().unwrap();

    s.fast.freeze().unwrap();
    let out = s.fast.copy_out(&image, None).unwrap();
    assert_eq!(chunk_list(&image), chunk_list(&reference));
    let st = s.driver.host_stats();
    assert_eq!((st.registrations, st.unregistrations), (1, 1), "{st:?}");
    assert_eq!(st.async_copies, chunks_of(&expected));
    assert!(st.peak_outstanding >= 2, "copies overlapped: {st:?}");
    assert!(st.peak_outstanding <= 3, "at most one per stream: {st:?}");
    assert_eq!(st.pageable_async_copies, 0);
    assert_eq!(s.driver.outstanding_copies(), 0);
    assert!(out.peak_staging_bytes <= 6 * CHUNK as u64);

    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    let copied = s.fast.copy_in(&image).unwrap();
    assert_eq!(copied.staging_bytes, 5 * CHUNK as u64);
    s.fast.thaw().unwrap();
    check(&s, &expected);
    let st = s.driver.host_stats();
    assert_eq!((st.registrations, st.unregistrations), (2, 2), "{st:?}");
    assert_eq!(st.async_copies, 2 * chunks_of(&expected));
    assert!(st.peak_outstanding <= 3);
    assert_eq!(st.pageable_async_copies, 0);
    assert_eq!(st.unregistered_under_dma, 0);
    assert_eq!(
        (s.driver.outstanding_copies(), s.driver.registered_ranges()),
        (0, 0)
    );
}

#[test]
fn driver_failures_mid_pipeline_leave_no_dma_and_no_image() {
    let failures = [
        (DriverCall::CopyToHost, 4),
        (DriverCall::Wait, 5),
        (DriverCall::RegisterHost, 0),
    ];
    for (call, skip) in failures {
        let s = setup_with(pipelined());
        let expected = populate(&s);
        let root = tempfile::tempdir().unwrap();
        let image = root.path().join("img");
        s.fast.freeze().unwrap();
        s.driver.fail_nth(call, skip);
        let result = s.fast.copy_out(&image, None);
        let st = s.driver.host_stats();
        if call == DriverCall::RegisterHost {
            // Not pinned: slower, still right.
            result.unwrap();
            assert!(st.pageable_async_copies > 0);
            assert_eq!(st.registrations, 0);
            continue;
        }
        let err = result.unwrap_err();
        assert!(
            matches!(err, FastPathError::Driver(ref e) if e.call == call),
            "{call:?}: {err}"
        );
        assert!(!image.exists(), "{call:?}: no image published");
        assert_eq!(s.driver.outstanding_copies(), 0, "{call:?}: DMA left");
        assert_eq!(s.driver.registered_ranges(), 0, "{call:?}: still pinned");
        assert_eq!(st.unregistered_under_dma, 0);
        assert!(st.peak_outstanding >= 2, "{call:?}: failed mid-pipeline");
        // The state is unchanged: a second attempt works and restores exactly.
        s.fast.copy_out(&image, None).unwrap();
        s.fast.release(false).unwrap();
        s.fast.remap().unwrap();
        s.fast.copy_in(&image).unwrap();
        s.fast.thaw().unwrap();
        check(&s, &expected);
    }
}

#[test]
fn failures_during_copy_in_leave_no_dma() {
    for (call, skip) in [(DriverCall::CopyFromHost, 6), (DriverCall::Wait, 3)] {
        let s = setup_with(pipelined());
        let expected = populate(&s);
        let root = tempfile::tempdir().unwrap();
        let image = root.path().join("img");
        s.fast.freeze().unwrap();
        s.fast.copy_out(&image, None).unwrap();
        s.fast.release(false).unwrap();
        s.fast.remap().unwrap();
        s.driver.fail_nth(call, skip);
        let err = s.fast.copy_in(&image).unwrap_err();
        assert!(
            matches!(err, FastPathError::Driver(ref e) if e.call == call),
            "{call:?}: {err}"
        );
        assert_eq!(s.driver.outstanding_copies(), 0, "{call:?}");
        assert_eq!(s.driver.registered_ranges(), 0, "{call:?}");
        assert_eq!(s.driver.host_stats().unregistered_under_dma, 0);
        s.fast.copy_in(&image).unwrap();
        s.fast.thaw().unwrap();
        check(&s, &expected);
    }

    // A corrupt chunk stops the copy-in the same way.
    let s = setup_with(pipelined());
    populate(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    s.fast.copy_out(&image, None).unwrap();
    let data = largest_data_file(&image);
    let mut bytes = std::fs::read(&data).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&data, bytes).unwrap();
    let err = s.fast.copy_in(&image).unwrap_err();
    assert!(
        matches!(err, FastPathError::Image(ImageError::CorruptChunk { .. })),
        "{err}"
    );
    assert_eq!(s.driver.outstanding_copies(), 0);
    assert_eq!(s.driver.registered_ranges(), 0);
}

#[test]
fn unpinned_copies_work_and_register_nothing() {
    let s = setup_with(FastPathOptions {
        pin: false,
        ..pipelined()
    });
    let expected = populate(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    s.fast.copy_out(&image, None).unwrap();
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    s.fast.copy_in(&image).unwrap();
    s.fast.thaw().unwrap();
    check(&s, &expected);
    let st = s.driver.host_stats();
    assert_eq!(st.registrations, 0);
    assert_eq!(st.pageable_async_copies, st.async_copies);
}
