//! Release with kept memory, reattach, remap and snapshots.

use super::*;

/// Frozen and copied out into a fresh image, ready for a release.
fn frozen_and_copied(s: &Setup) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    s.fast.freeze().unwrap();
    s.fast.copy_out(&root.path().join("img"), None).unwrap();
    root
}

#[test]
fn kept_memory_is_reattached_without_a_copy() {
    let s = setup();
    let expected = populate(&s);
    let physical = s.driver.physical_bytes();
    let _image = frozen_and_copied(&s);
    let (report, fds) = s.fast.release(true).unwrap();
    assert_eq!(report.held.len(), expected.len());
    assert_eq!(fds.len(), expected.len());
    // Released by the process, alive through the fds.
    assert_eq!(s.driver.mappings(), 0);
    assert_eq!(s.driver.physical_bytes(), physical);
    let copies_before = s.driver.host_stats();
    s.fast.reattach(&report.held, fds).unwrap();
    assert_eq!(s.driver.host_stats(), copies_before, "no copy");
    for (va, data) in &expected {
        assert_eq!(&read(&s.driver, *va, data.len() as u64), data);
    }
    s.fast.thaw().unwrap();
    assert_eq!(s.driver.physical_bytes(), physical);
}

#[test]
fn reattach_refuses_other_memory_and_remap_still_works() {
    let s = setup();
    let expected = populate(&s);
    let image = frozen_and_copied(&s);
    let (report, mut fds) = s.fast.release(true).unwrap();
    // The fds in another order than the addresses: not the memory released there.
    fds.swap(0, 1);
    let err = s.fast.reattach(&report.held, fds).unwrap_err();
    assert!(matches!(err, FastPathError::NotKept(_)), "{err}");
    assert_eq!(s.driver.mappings(), 0, "nothing mapped");
    // Fewer addresses than kept.
    let err = s.fast.reattach(&report.held[1..], Vec::new()).unwrap_err();
    assert!(matches!(err, FastPathError::NotKept(_)), "{err}");
    // The fallback: new memory, filled from the image.
    s.fast.remap().unwrap();
    s.fast.copy_in(&image.path().join("img")).unwrap();
    for (va, data) in &expected {
        assert_eq!(&read(&s.driver, *va, data.len() as u64), data);
    }
    s.fast.thaw().unwrap();
}

#[test]
fn a_failed_export_keeps_nothing_and_releases_as_usual() {
    let s = setup();
    populate(&s);
    let _image = frozen_and_copied(&s);
    s.driver.fail_nth(DriverCall::Export, 2);
    let (report, fds) = s.fast.release(true).unwrap();
    assert!(report.held.is_empty() && fds.is_empty());
    // Released (the two exported first are freed as their fds close; the fake cannot
    // see that and keeps them).
    assert_eq!(s.driver.mappings(), 0);
    assert_eq!(report.allocations, 7);
    // Without keep in the options, nothing is exported either.
    let s = setup_with(FastPathOptions {
        keep: false,
        ..opts()
    });
    populate(&s);
    let _image = frozen_and_copied(&s);
    let (report, _) = s.fast.release(true).unwrap();
    assert!(report.held.is_empty());
}

#[test]
fn reattached_memory_is_kept_again_at_the_next_checkpoint() {
    let s = setup();
    let expected = populate(&s);
    for round in 0..3 {
        let _image = frozen_and_copied(&s);
        let (report, fds) = s.fast.release(true).unwrap();
        assert_eq!(report.held.len(), expected.len(), "round {round}");
        s.fast.reattach(&report.held, fds).unwrap();
        s.fast.thaw().unwrap();
        for (va, data) in &expected {
            assert_eq!(
                &read(&s.driver, *va, data.len() as u64),
                data,
                "round {round}"
            );
        }
    }
    // No room for the device copy: the reattached memory stays, the next keep keeps
    // nothing (and the copy-in path takes over).
    let _image = frozen_and_copied(&s);
    let (report, fds) = s.fast.release(true).unwrap();
    s.driver.fail_next(DriverCall::Create);
    s.driver.fail_nth(DriverCall::Create, 0);
    s.fast.reattach(&report.held, fds).unwrap();
    for (va, data) in &expected {
        assert_eq!(&read(&s.driver, *va, data.len() as u64), data);
    }
    s.fast.thaw().unwrap();
    let _image = frozen_and_copied(&s);
    let (report, _) = s.fast.release(true).unwrap();
    assert!(report.held.is_empty());
    assert_eq!(
        s.driver.reservations(),
        expected.len(),
        "no temporary address left"
    );
}

#[test]
fn a_renewal_that_cannot_map_the_new_memory_puts_the_old_back() {
    let s = setup();
    let expected = populate(&s);
    let _image = frozen_and_copied(&s);
    let (report, fds) = s.fast.release(true).unwrap();
    // Reattach maps each allocation once; the renewal maps the copy twice (temporary
    // address, then the allocation's): fail the first renewal's second map.
    s.driver.fail_nth(DriverCall::Map, report.held.len() + 1);
    s.fast.reattach(&report.held, fds).unwrap();
    for (va, data) in &expected {
        assert_eq!(&read(&s.driver, *va, data.len() as u64), data);
    }
    s.fast.thaw().unwrap();
}

/// Frozen, then a snapshot taken: its report and the fds the shim would hold.
fn snapshotted(s: &Setup) -> (SnapshotReport, Vec<OwnedFd>) {
    s.fast.freeze().unwrap();
    s.fast.snapshot().unwrap()
}

#[test]
fn a_snapshot_is_written_after_the_thaw_as_the_memory_was_at_the_freeze() {
    let s = setup();
    let expected = populate(&s);
    let n = expected.len();
    let (report, fds) = snapshotted(&s);
    assert_eq!(report.release.allocations, n);
    assert_eq!(report.release.held.len(), 1, "the snapshot alone is kept");
    assert_eq!(fds.len(), 1);
    let sizes: u64 = expected
        .iter()
        .map(|(va, _)| s.allocator.get(*va).unwrap().mapped_size)
        .sum();
    assert_eq!(report.snapshot_bytes, sizes);
    assert_eq!(s.driver.mappings(), 0, "memory and snapshot released");
    assert_eq!(s.driver.reservations(), n + 1);
    // The allocations' memory is freed; the snapshot's lives on through its fd.
    assert_eq!(s.driver.physical_bytes(), sizes);
    let err = s.fast.write_snapshot(Path::new("/nonexistent"), None);
    assert!(
        matches!(err, Err(FastPathError::NoSnapshot(_))),
        "not mapped yet"
    );
    let host = s.driver.host_stats();
    s.fast.reattach(&report.release.held, fds).unwrap();
    assert_eq!(s.driver.host_stats(), host, "nothing through the host");
    s.fast.thaw().unwrap();
    check(&s, &expected);
    // The workload runs on and changes all its memory before the image is written.
    for (va, data) in &expected {
        s.driver
            .copy_from_host(*va, &vec![0x5a; data.len()])
            .unwrap();
    }
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    let rep = s.fast.write_snapshot(&image, None).unwrap();
    assert_eq!(rep.allocations, n);
    assert_eq!(s.driver.reservations(), n, "the snapshot is freed");
    assert!(matches!(
        s.fast.write_snapshot(&root.path().join("again"), None),
        Err(FastPathError::NoSnapshot(_))
    ));
    // The image is the memory at the freeze: copied in, it is back.
    s.fast.freeze().unwrap();
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    s.fast.copy_in(&image).unwrap();
    s.fast.thaw().unwrap();
    check(&s, &expected);
    // And the next checkpoint can snapshot the reattached memory again.
    let (report, fds) = snapshotted(&s);
    assert_eq!(fds.len(), 1);
    s.fast.reattach(&report.release.held, fds).unwrap();
    s.fast.thaw().unwrap();
    s.fast.drop_snapshot();
    assert_eq!(s.driver.reservations(), n);
    check(&s, &expected);
}

#[test]
fn a_snapshot_that_cannot_be_taken_changes_nothing() {
    let n;
    {
        // No room: the snapshot would leave less than the headroom free.
        let s = setup_with(FastPathOptions {
            snapshot_headroom: 256 * G,
            ..opts()
        });
        let expected = populate(&s);
        n = expected.len();
        s.fast.freeze().unwrap();
        let err = s.fast.snapshot().unwrap_err();
        assert!(
            matches!(err, FastPathError::Snapshot(SnapshotError::NoRoom { .. })),
            "{err}"
        );
        assert_eq!(s.driver.reservations(), n);
        check(&s, &expected);
        // Off in the options.
        let s = setup_with(FastPathOptions {
            snapshot: false,
            ..opts()
        });
        populate(&s);
        s.fast.freeze().unwrap();
        assert!(matches!(
            s.fast.snapshot(),
            Err(FastPathError::NoSnapshot(_))
        ));
    }
    // An export, the device copy, or a release half-way fails.
    for (call, skip) in [
        (DriverCall::Export, 0),
        (DriverCall::CopyDevice, 3),
        (DriverCall::Release, 3),
    ] {
        let s = setup();
        let expected = populate(&s);
        let physical = s.driver.physical_bytes();
        s.fast.freeze().unwrap();
        s.driver.fail_nth(call, skip);
        let err = s.fast.snapshot().unwrap_err();
        assert_eq!(s.driver.reservations(), n, "{call:?}: {err}");
        check(&s, &expected);
        if call != DriverCall::Release {
            assert_eq!(s.driver.physical_bytes(), physical, "{call:?}");
        }
        // Still frozen, nothing kept: the snapshot can be tried again.
        let (report, fds) = s.fast.snapshot().unwrap();
        s.fast.reattach(&report.release.held, fds).unwrap();
        s.fast.thaw().unwrap();
        s.fast.drop_snapshot();
        check(&s, &expected);
    }
}

#[test]
fn a_process_restored_from_a_snapshot_checkpoint_remaps_and_copies_in() {
    let s = setup();
    let expected = populate(&s);
    // The image the checkpoint wrote (from the snapshot, after the dump).
    let root = frozen_and_copied(&s);
    // The dump saw the process Snapshotted; restored elsewhere, no fd comes back.
    let (_, fds) = s.fast.snapshot().unwrap();
    drop(fds);
    s.fast.remap().unwrap();
    assert_eq!(
        s.driver.reservations(),
        expected.len(),
        "snapshot range freed"
    );
    s.fast.copy_in(&root.path().join("img")).unwrap();
    s.fast.thaw().unwrap();
    check(&s, &expected);
    assert!(matches!(
        s.fast.write_snapshot(&root.path().join("x"), None),
        Err(FastPathError::NoSnapshot(_))
    ));
}
