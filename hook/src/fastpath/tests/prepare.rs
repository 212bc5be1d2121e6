//! Prepare: a copy-out readied ahead, used or dropped.

use super::*;

/// Prepare with windows of 3 chunks (so several are registered).
fn preparing() -> FastPathOptions {
    FastPathOptions {
        direct_window: 3 * CHUNK,
        ..pipelined()
    }
}

/// Names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_prepared_copy_out_moves_straight_into_the_registered_file() {
    let Some(root) = tmpfs_dir() else { return };
    let s = setup_with(preparing());
    let expected = populate_with_duplicates(&s);
    let image = root.path().join("img");
    let before = s.driver.host_stats();
    let prepared = s.fast.prepare(&image, None).unwrap();
    assert!(s.fast.is_prepared());
    assert!(prepared.windows > 2, "{prepared:?}");
    assert_eq!(
        s.driver.host_stats().registrations - before.registrations,
        prepared.windows
    );
    // Written while the workload runs: nothing published, nothing copied yet.
    assert!(!image.exists());
    assert_eq!(s.driver.host_stats().async_copies, before.async_copies);

    s.fast.freeze().unwrap();
    let reference = root.path().join("ref");
    FastPath::new(s.allocator.clone(), s.gate.clone(), pipelined())
        .copy_out(&reference, None)
        .unwrap();
    let mid = s.driver.host_stats();
    let out = s.fast.copy_out(&image, None).unwrap();
    assert!(!s.fast.is_prepared());
    assert_eq!(out.peak_staging_bytes, 0, "no chunk staged");
    let st = s.driver.host_stats();
    assert_eq!(
        st.registrations, mid.registrations,
        "registered by the Prepare"
    );
    assert_eq!(st.async_copies - mid.async_copies, chunks_of(&expected));
    assert_eq!(st.pageable_async_copies, 0);
    assert_eq!(st.unregistered_under_dma, 0);
    assert_eq!(
        (s.driver.outstanding_copies(), s.driver.registered_ranges()),
        (0, 0)
    );
    assert_eq!(full_records(&image), full_records(&reference));
    let (blocks, len) = data_usage(&image);
    assert!(blocks < len, "zero and duplicate chunks are holes");
    assert_eq!(names_in(root.path()), ["img", "ref"]);
    round_trip(&s, &image, &expected);
}

#[test]
fn a_prepared_copy_out_for_another_image_or_other_allocations_is_dropped() {
    let Some(root) = tmpfs_dir() else { return };
    // Another image: the prepared one goes, the CopyOut stages.
    let s = setup_with(preparing());
    let mut expected = populate(&s);
    s.fast.prepare(&root.path().join("a"), None).unwrap();
    s.fast.freeze().unwrap();
    let b = root.path().join("b");
    let out = s.fast.copy_out(&b, None).unwrap();
    assert!(out.peak_staging_bytes > 0, "staged");
    assert!(!s.fast.is_prepared());
    assert_eq!(s.driver.registered_ranges(), 0);
    assert_eq!(names_in(root.path()), ["b"], "the prepared image is gone");
    round_trip(&s, &b, &expected);

    // An allocation made after the Prepare: not the prepared layout.
    let c = root.path().join("c");
    s.fast.prepare(&c, None).unwrap();
    let data = vec![7u8; CHUNK + 4096];
    let va = s.allocator.alloc(data.len() as u64).unwrap();
    s.driver.copy_from_host(va, &data).unwrap();
    expected.push((va, data));
    s.fast.freeze().unwrap();
    let out = s.fast.copy_out(&c, None).unwrap();
    assert!(out.peak_staging_bytes > 0, "staged");
    assert_eq!(s.driver.registered_ranges(), 0);
    assert_eq!(names_in(root.path()), ["b", "c"]);
    round_trip(&s, &c, &expected);

    // Thaw (and Snapshot) without a CopyOut drop it.
    let d = root.path().join("d");
    s.fast.prepare(&d, None).unwrap();
    s.fast.freeze().unwrap();
    Engine::thaw(&s.fast).unwrap();
    assert!(!s.fast.is_prepared());
    s.fast.prepare(&d, None).unwrap();
    s.fast.freeze().unwrap();
    let _ = Engine::snapshot(&s.fast);
    assert!(!s.fast.is_prepared());
    s.fast.drop_snapshot();
    assert_eq!(s.driver.registered_ranges(), 0);
    assert_eq!(names_in(root.path()), ["b", "c"]);
}

#[test]
fn prepare_is_refused_off_tmpfs_when_off_or_failing_and_holds_nothing() {
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let s = setup_with(preparing());
    populate(&s);
    let err = s.fast.prepare(&disk.path().join("img"), None).unwrap_err();
    assert!(matches!(err, FastPathError::NotPrepared(_)), "{err}");
    assert!(err.to_string().contains("tmpfs"), "{err}");
    assert!(!s.fast.is_prepared());
    assert!(names_in(disk.path()).is_empty());

    let Some(root) = tmpfs_dir() else { return };
    let off = setup_with(FastPathOptions {
        prepare: false,
        ..preparing()
    });
    populate(&off);
    let err = off
        .fast
        .prepare(&root.path().join("img"), None)
        .unwrap_err();
    assert!(err.to_string().contains("GPUCR_HOOK_PREPARE=0"), "{err}");

    // A window that cannot be registered: all or nothing.
    s.driver.fail_nth(DriverCall::RegisterHost, 1);
    let err = s.fast.prepare(&root.path().join("img"), None).unwrap_err();
    assert!(matches!(err, FastPathError::Driver(_)), "{err}");
    assert!(!s.fast.is_prepared());
    assert_eq!(s.driver.registered_ranges(), 0);
    assert!(names_in(root.path()).is_empty());
}

#[test]
fn a_prepared_incremental_copy_out_lays_out_only_what_changed() {
    let Some(root) = tmpfs_dir() else { return };
    let s = with_device_hash(preparing());
    let mut expected = populate_hashable(&s);
    let (full, delta) = (root.path().join("full"), root.path().join("delta"));
    let prepared = s.fast.prepare(&full, None).unwrap();
    s.fast.freeze().unwrap();
    let out = s.fast.copy_out(&full, None).unwrap();
    assert!(out.zero_chunks > 0, "{out:?}");
    assert_eq!(out.peak_staging_bytes, 0);
    // Resolved on the GPU after the file was laid out: their places were punched.
    let (blocks, _) = data_usage(&full);
    assert!(
        blocks <= out.copied_bytes + 16 * 4096,
        "{blocks} allocated of the {} prepared for {out:?}",
        prepared.bytes
    );
    assert_eq!(s.driver.registered_ranges(), 0);
    s.fast.thaw().unwrap();

    // One chunk changes before the Prepare: only it and the odd-sized allocation (which
    // gh1 cannot hash) get places.
    let change = |expected: &mut Vec<(u64, Vec<u8>)>, byte: usize| {
        let (va, data) = &mut expected[2];
        data[byte] ^= 0xff;
        s.driver.copy_from_host(*va, data).unwrap();
    };
    change(&mut expected, 3 * CHUNK + 5);
    let prepared = s.fast.prepare(&delta, Some(&full)).unwrap();
    assert_eq!(prepared.bytes, (CHUNK + 4096) as u64, "{prepared:?}");
    // Another changes after it: no place, so it is staged.
    change(&mut expected, CHUNK + 7);
    s.fast.freeze().unwrap();
    let before = s.driver.host_stats();
    let out = s.fast.copy_out(&delta, Some(&full)).unwrap();
    let moved = s.driver.host_stats().bytes_to_host - before.bytes_to_host;
    assert_eq!(moved, 2 * CHUNK as u64 + 4095, "{out:?}");
    assert!(
        out.peak_staging_bytes > 0,
        "the late change staged: {out:?}"
    );
    assert!(out.parent_chunks > 0);
    assert_eq!(s.driver.registered_ranges(), 0);
    round_trip(&s, &delta, &expected);

    // Nothing changed since: only the allocation gh1 cannot hash gets a place.
    let again = root.path().join("again");
    let p = s.fast.prepare(&again, Some(&delta)).unwrap();
    assert_eq!(p.bytes, 4096, "{p:?}");
    s.fast.drop_prepared();
    assert_eq!(s.driver.registered_ranges(), 0);
}
