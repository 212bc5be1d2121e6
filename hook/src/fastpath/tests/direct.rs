//! Direct copy-out into tmpfs images and direct copy-in from mapped ones; the windows.

use super::*;

#[test]
fn direct_copy_out_writes_the_staged_image_without_zeros_or_duplicates() {
    let Some(root) = tmpfs_dir() else { return };
    let s = setup_with(direct());
    let expected = populate_with_duplicates(&s);
    s.fast.freeze().unwrap();
    // The same memory through staging, for comparison.
    let staged = FastPath::new(s.allocator.clone(), s.gate.clone(), pipelined());
    let reference = root.path().join("ref");
    staged.copy_out(&reference, None).unwrap();
    let before = s.driver.host_stats();

    let image = root.path().join("img");
    let out = s.fast.copy_out(&image, None).unwrap();
    assert_eq!(out.peak_staging_bytes, 0, "no chunk staged");
    assert_eq!(full_records(&image), full_records(&reference));
    let records = full_records(&image);
    assert!(records.iter().flat_map(|a| &a.1).any(|c| c.4 == "zero"));
    let (last, copy) = (&records[5].1, &records[records.len() - 1].1);
    assert_eq!(last.len(), copy.len());
    assert!(
        last.iter().zip(copy).all(|(a, b)| a.4 == b.4),
        "deduplicated"
    );

    let st = s.driver.host_stats();
    // Only windows: the staging pool was never used, so never pinned.
    let windows = st.registrations - before.registrations;
    assert!(windows > 2, "windows moved along: {st:?}");
    assert_eq!(st.async_copies - before.async_copies, chunks_of(&expected));
    assert_eq!(st.pageable_async_copies, 0, "every copy registered");
    assert_eq!(st.unregistered_under_dma, 0);
    assert!(st.peak_outstanding <= 3);
    assert_eq!(
        (s.driver.outstanding_copies(), s.driver.registered_ranges()),
        (0, 0)
    );
    // Zero and duplicate chunks are holes: fewer blocks than bytes, and no more
    // than the staged image stores (plus page padding of short chunks).
    let (blocks, len) = data_usage(&image);
    let (ref_blocks, ref_len) = data_usage(&reference);
    assert!(blocks < len, "holes: {blocks} allocated of {len}");
    assert!(len > ref_len, "the direct file keeps its layout");
    assert!(blocks <= ref_blocks + 8 * 4096, "{blocks} vs {ref_blocks}");
    round_trip(&s, &image, &expected);
}

#[test]
fn direct_registration_failures_fall_back_to_staging() {
    let Some(root) = tmpfs_dir() else { return };
    // 0: the first window (all staged); 2: a later one (mixed).
    for skip in [0, 2] {
        let s = setup_with(direct());
        let expected = populate_with_duplicates(&s);
        s.fast.freeze().unwrap();
        let reference = root.path().join(format!("ref-{skip}"));
        FastPath::new(s.allocator.clone(), s.gate.clone(), pipelined())
            .copy_out(&reference, None)
            .unwrap();
        let before = s.driver.host_stats();
        s.driver.fail_nth(DriverCall::RegisterHost, skip);
        let image = root.path().join(format!("img-{skip}"));
        s.fast.copy_out(&image, None).unwrap();
        assert_eq!(full_records(&image), full_records(&reference), "{skip}");
        let st = s.driver.host_stats();
        // The windows before the failure (and one registered ahead), then the
        // staging pool; all undone.
        let made = st.registrations - before.registrations;
        assert!((skip + 1..=skip + 2).contains(&made), "{st:?}");
        assert_eq!(st.registrations, st.unregistrations);
        assert_eq!(st.pageable_async_copies, 0);
        assert_eq!(
            (s.driver.outstanding_copies(), s.driver.registered_ranges()),
            (0, 0)
        );
        round_trip(&s, &image, &expected);
    }
}

#[test]
fn direct_driver_failures_publish_nothing_and_leave_nothing_registered() {
    let Some(root) = tmpfs_dir() else { return };
    for (call, skip) in [(DriverCall::CopyToHost, 4), (DriverCall::Wait, 5)] {
        let s = setup_with(direct());
        let expected = populate_with_duplicates(&s);
        s.fast.freeze().unwrap();
        let image = root.path().join("img");
        s.driver.fail_nth(call, skip);
        let err = s.fast.copy_out(&image, None).unwrap_err();
        assert!(
            matches!(err, FastPathError::Driver(ref e) if e.call == call),
            "{call:?}: {err}"
        );
        assert!(!image.exists(), "{call:?}: no image published");
        let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
        assert!(left.is_empty(), "{call:?}: temporary files left: {left:?}");
        let st = s.driver.host_stats();
        assert_eq!(
            (s.driver.outstanding_copies(), s.driver.registered_ranges()),
            (0, 0),
            "{call:?}"
        );
        assert_eq!(st.unregistered_under_dma, 0);
        assert!(st.peak_outstanding >= 2, "{call:?}: failed mid-pipeline");
        s.fast.copy_out(&image, None).unwrap();
        round_trip(&s, &image, &expected);
        std::fs::remove_dir_all(&image).unwrap();
    }
}

#[test]
fn direct_is_not_used_off_tmpfs_or_when_compressing() {
    // Off tmpfs: a directory next to the sources (the workspace is on a disk).
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let cases = [
        (disk.path().to_path_buf(), direct(), None),
        (
            std::path::PathBuf::new(),
            FastPathOptions {
                image: ImageOptions {
                    compression: Compression::Zstd { level: 1 },
                    ..direct().image
                },
                ..direct()
            },
            tmpfs_dir(),
        ),
    ];
    for (dir, opts, tmp) in cases {
        let dir = match &tmp {
            Some(t) => t.path().to_path_buf(),
            None if dir.as_os_str().is_empty() => continue,
            None => dir,
        };
        if gpu_state::image::is_tmpfs(&dir) && tmp.is_none() {
            eprintln!("skipped: {} is tmpfs", dir.display());
            continue;
        }
        let s = setup_with(opts);
        let expected = populate(&s);
        s.fast.freeze().unwrap();
        let image = dir.join("img");
        s.fast.copy_out(&image, None).unwrap();
        let st = s.driver.host_stats();
        assert_eq!(st.registrations, 1, "only the staging pool: {st:?}");
        round_trip(&s, &image, &expected);
    }
}

#[test]
fn direct_copy_in_reads_straight_from_the_mapped_image() {
    let Some(root) = tmpfs_dir() else { return };
    let s = setup_with(direct());
    let expected = populate_with_duplicates(&s);
    s.fast.freeze().unwrap();
    // A direct image (one file) and a staged one (several files, unaligned chunks).
    let staged = root.path().join("staged");
    FastPath::new(s.allocator.clone(), s.gate.clone(), pipelined())
        .copy_out(&staged, None)
        .unwrap();
    let image = root.path().join("img");
    s.fast.copy_out(&image, None).unwrap();
    for dir in [&image, &staged] {
        s.fast.release(false).unwrap();
        s.fast.remap().unwrap();
        let before = s.driver.host_stats();
        let report = s.fast.copy_in(dir).unwrap();
        let st = s.driver.host_stats();
        // The zero buffer, then windows of 3 chunks over the data files.
        assert!(
            st.registrations - before.registrations > 3,
            "{dir:?} {before:?} {st:?}"
        );
        assert_eq!(report.staging_bytes, CHUNK as u64, "one zero buffer");
        assert_eq!(st.async_copies - before.async_copies, chunks_of(&expected));
        assert_eq!(st.pageable_async_copies, 0, "{dir:?}");
        assert_eq!(st.unregistered_under_dma, 0);
        assert!(st.peak_outstanding <= 3);
        assert_eq!(
            (s.driver.outstanding_copies(), s.driver.registered_ranges()),
            (0, 0)
        );
        check_memory(&s.driver, &s.allocator, &expected);
    }
}

#[test]
fn direct_copy_in_failures_leave_nothing_behind() {
    let Some(root) = tmpfs_dir() else { return };
    let s = setup_with(direct());
    let expected = populate_with_duplicates(&s);
    s.fast.freeze().unwrap();
    let image = root.path().join("img");
    s.fast.copy_out(&image, None).unwrap();
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    for (call, skip) in [(DriverCall::CopyFromHost, 6), (DriverCall::Wait, 3)] {
        s.driver.fail_nth(call, skip);
        let err = s.fast.copy_in(&image).unwrap_err();
        assert!(
            matches!(err, FastPathError::Driver(ref e) if e.call == call),
            "{call:?}: {err}"
        );
        assert_eq!(
            (s.driver.outstanding_copies(), s.driver.registered_ranges()),
            (0, 0),
            "{call:?}"
        );
        assert_eq!(s.driver.host_stats().unregistered_under_dma, 0);
    }
    // A registration failing at a later window: the staged path does it all.
    s.driver.fail_nth(DriverCall::RegisterHost, 3);
    s.fast.copy_in(&image).unwrap();
    assert_eq!(s.driver.registered_ranges(), 0);
    check_memory(&s.driver, &s.allocator, &expected);

    // A damaged chunk stops it before its copy.
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
    assert_eq!(
        (s.driver.outstanding_copies(), s.driver.registered_ranges()),
        (0, 0)
    );
}

#[test]
fn windows_are_page_disjoint_and_bounded() {
    const P: usize = 4096;
    // Aligned spans of 3 pages, windows of 7 pages: two spans a window.
    let spans = (0..5).map(|i| Some((0x10_0000 + i * 3 * P, 3 * P, 0)));
    let (w, of) = plan_windows(spans, 7 * P);
    assert_eq!(
        w,
        vec![
            (0x10_0000, 0x10_0000 + 6 * P),
            (0x10_0000 + 6 * P, 0x10_0000 + 12 * P),
            (0x10_0000 + 12 * P, 0x10_0000 + 15 * P)
        ]
    );
    let one = |w| Some((w, 0));
    assert_eq!(of, vec![one(0), one(0), one(1), one(1), one(2)]);
    // An unaligned span starting in the previous window's last page: its head is
    // copied apart and the window starts at the next page; a span inside that page
    // joins the previous window; a new group starts a new one; `None` needs none.
    let b = 0x20_0000;
    let spans = [
        None,
        Some((b, 2 * P + 100, 0)),
        Some((b + 2 * P + 100, 2 * P, 0)),
        Some((b + 4 * P + 100, 10, 0)),
        // A duplicate of the split one: split the same way.
        Some((b + 2 * P + 100, 2 * P, 0)),
        Some((0x30_0000, 10, 1)),
    ];
    let (w, of) = plan_windows(spans, 2 * P);
    let split = Some((1, P - 100));
    assert_eq!(of, vec![None, one(0), split, one(1), split, one(2)]);
    assert_eq!(w[0], (b, b + 2 * P + 100));
    assert_eq!(w[1], (b + 3 * P, b + 4 * P + 110));
    assert_eq!(w[2], (0x30_0000, 0x30_0000 + 10));
    for pair in w.windows(2) {
        assert!(pair[0].1.next_multiple_of(P) <= pair[1].0, "{w:x?}");
    }
}

#[test]
fn direct_needs_pinning() {
    let Some(root) = tmpfs_dir() else { return };
    let s = setup_with(FastPathOptions {
        pin: false,
        ..direct()
    });
    let expected = populate(&s);
    s.fast.freeze().unwrap();
    let image = root.path().join("img");
    s.fast.copy_out(&image, None).unwrap();
    round_trip(&s, &image, &expected);
    let st = s.driver.host_stats();
    assert_eq!(st.registrations, 0);
    assert_eq!(st.pageable_async_copies, st.async_copies);
}

#[test]
fn direct_delta_images_refer_to_their_parent() {
    let Some(root) = tmpfs_dir() else { return };
    let s = setup_with(direct());
    let mut expected = populate_with_duplicates(&s);
    let (full, delta) = (root.path().join("full"), root.path().join("delta"));
    s.fast.freeze().unwrap();
    s.fast.copy_out(&full, None).unwrap();
    s.fast.thaw().unwrap();
    let (va, data) = &mut expected[3];
    data[5] ^= 0xff;
    s.driver.copy_from_host(*va, data).unwrap();
    s.fast.freeze().unwrap();
    let reference = root.path().join("ref");
    FastPath::new(s.allocator.clone(), s.gate.clone(), pipelined())
        .copy_out(&reference, Some(&full))
        .unwrap();
    s.fast.copy_out(&delta, Some(&full)).unwrap();
    assert_eq!(full_records(&delta), full_records(&reference));
    // One chunk changed: one stored, the rest zero or in the parent.
    let m = ImageReader::open(&delta).unwrap().manifest().clone();
    let stored = m
        .allocations
        .iter()
        .flat_map(|a| &a.chunks)
        .filter(|c| matches!(c.at, gpu_state::image::Location::Data { .. }))
        .count();
    assert_eq!(stored, 1);
    // The direct file keeps its layout (cut after that chunk), the rest are holes.
    assert_eq!(data_usage(&delta).0, CHUNK as u64);
    round_trip(&s, &delta, &expected);
    assert_eq!(
        (s.driver.outstanding_copies(), s.driver.registered_ranges()),
        (0, 0)
    );
}
