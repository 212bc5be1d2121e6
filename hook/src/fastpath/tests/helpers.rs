//! Copy-in helpers: failures, Warm, helpers the shim started.

use super::*;

/// Copy-in helpers that do not work out lose nothing: one that never says Ready is
/// stopped unused, one that fails its job has its share staged after the others, the
/// memory comes back exact, and the next freeze finds every helper reaped.
#[test]
fn copy_in_helpers_that_fail_leave_their_share_to_the_staged_copy() {
    let Some(root) = tmpfs_dir() else { return };
    let bin = tempfile::tempdir().unwrap();
    let pids = bin.path().join("pids");
    // A helper speaks length-prefixed JSON frames on the fd it is given.
    let ready = r#"{"reply":"Ready","init_s":0.1}"#;
    let failed = r#"{"reply":"Failed","message":"test helper fails"}"#;
    let script = |name: &str, body: &str| {
        let path = bin.path().join(name);
        std::fs::write(
            &path,
            format!("#!/bin/bash\necho $$ >> {}\n{body}\n", pids.display()),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        path
    };
    let frame = |json: &str| {
        format!(
            "printf '\\0\\0\\0\\{:03o}%s' '{json}' >&$GPUCR_COPYIN_SOCKET_FD",
            json.len()
        )
    };
    let failing = script(
        "failing",
        &format!("{}\n{}\nexec sleep 30", frame(ready), frame(failed)),
    );
    let never = script("never", "exec sleep 30");

    for (helper, n, want_reports) in [(failing, 2, 2), (never, 1, 0)] {
        let s = with_device_hash(FastPathOptions {
            copy_in_helpers: n,
            helper_path: Some(helper.clone()),
            helper_share: Some(0.5),
            ..pipelined()
        });
        s.driver.set_device_ordinal(Some(0));
        let expected = populate_hashable(&s);
        s.fast.freeze().unwrap();
        let image = root.path().join(format!("img-{n}"));
        s.fast.copy_out(&image, None).unwrap();
        s.fast.release(false).unwrap();
        // The failing helpers get their jobs at the copy-in; the one never ready gets
        // its job ahead (it is stopped with the job unread).
        let ahead = (n == 1).then_some(image.as_path());
        let warm = s.fast.warm(ahead).unwrap();
        assert_eq!(warm.helpers, n);
        assert_eq!(warm.ahead_bytes > 0, ahead.is_some(), "{warm:?}");
        // Warm again: the same helpers, the same jobs.
        assert_eq!(s.fast.warm(ahead).unwrap(), warm);
        std::thread::sleep(Duration::from_millis(300));
        s.fast.remap().unwrap();
        let report = s.fast.copy_in(&image).unwrap();
        assert_eq!(report.helpers.len(), want_reports, "{helper:?}");
        for h in &report.helpers {
            assert_eq!(h.error.as_deref(), Some("test helper fails"));
            assert!(h.bytes > 0);
        }
        s.fast.thaw().unwrap();
        check_memory(&s.driver, &s.allocator, &expected);
        // Every helper is gone once the next freeze returns.
        s.fast.freeze().unwrap();
        for pid in std::fs::read_to_string(&pids).unwrap().lines() {
            let pid = nix::unistd::Pid::from_raw(pid.trim().parse().unwrap());
            assert_eq!(
                nix::sys::signal::kill(pid, None),
                Err(nix::errno::Errno::ESRCH),
                "helper {pid} still there"
            );
        }
        s.fast.thaw().unwrap();
        std::fs::remove_file(&pids).unwrap();
    }
}

/// Without a helper binary, or one that cannot start, Warm starts none and the copy-in
/// stages everything.
#[test]
fn warm_without_a_usable_helper_starts_none() {
    let Some(root) = tmpfs_dir() else { return };
    for (path, ordinal) in [
        (None, Some(0)),
        (Some(PathBuf::from("/nonexistent/gpucr-copyin")), Some(0)),
        (Some(PathBuf::from("/bin/true")), None),
    ] {
        let s = with_device_hash(FastPathOptions {
            copy_in_helpers: 2,
            helper_path: path.clone(),
            ..pipelined()
        });
        s.driver.set_device_ordinal(ordinal);
        let expected = populate_hashable(&s);
        s.fast.freeze().unwrap();
        let image = root.path().join("img");
        s.fast.copy_out(&image, None).unwrap();
        s.fast.release(false).unwrap();
        assert_eq!(
            s.fast.warm(Some(&image)).unwrap(),
            WarmReport::default(),
            "{path:?}"
        );
        s.fast.remap().unwrap();
        let report = s.fast.copy_in(&image).unwrap();
        assert!(report.helpers.is_empty());
        s.fast.thaw().unwrap();
        check_memory(&s.driver, &s.allocator, &expected);
        std::fs::remove_dir_all(&image).unwrap();
    }
}

/// Not a test of its own: the body of a fake copy-in helper when the test binary is
/// started as one (`fake_helper_script`). It takes its job, logs it, takes the Go and
/// says Done without copying anything.
#[test]
fn fake_copyin_helper() {
    use crate::helper::{helper_socket, next_go, next_job, say, HelperMsg, ENV_SOCKET_FD};
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let (Some(_), Some(log)) = (
        std::env::var_os(ENV_SOCKET_FD),
        std::env::var_os("GPUCR_FAKE_HELPER_LOG"),
    ) else {
        return;
    };
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .unwrap();
    let mut sock = helper_socket().unwrap();
    say(&mut sock, &HelperMsg::Ready { init_s: 0.0 }).unwrap();
    let (job, files) = next_job(&mut sock).unwrap().unwrap();
    let files: Vec<std::fs::File> = files.into_iter().map(std::fs::File::from).collect();
    let mut bytes = 0;
    for p in &job.pieces {
        let mut buf = vec![0; p.len as usize];
        files[p.file]
            .read_exact_at(&mut buf, p.file_offset)
            .unwrap();
        bytes += p.len;
    }
    // One write per line: the helpers append to one log at once (O_APPEND).
    log.write_all(format!("job {} {bytes}\n", job.pieces.len()).as_bytes())
        .unwrap();
    let (memory, sizes) = next_go(&mut sock, &job).unwrap().unwrap();
    log.write_all(format!("go {} {sizes:?}\n", memory.len()).as_bytes())
        .unwrap();
    if std::env::var_os("GPUCR_FAKE_HELPER_FAIL").is_some() {
        let failed = HelperMsg::Failed {
            message: "told to fail".into(),
        };
        say(&mut sock, &failed).unwrap();
        let _ = next_job(&mut sock);
        std::process::exit(0);
    }
    let done = HelperMsg::Done {
        bytes,
        seconds: 0.0,
        setup_s: 0.0,
        register_s: 0.0,
        ahead_s: 0.0,
        pin_wait_s: 0.0,
    };
    say(&mut sock, &done).unwrap();
    let _ = next_job(&mut sock);
    std::process::exit(0);
}

/// A script that starts this test binary as a fake helper logging into `log`.
fn fake_helper_script(dir: &Path, log: &Path) -> PathBuf {
    fake_helper_script_as(dir, log, false)
}

/// As [`fake_helper_script`]; with `fail`, each helper says Failed after its Go.
fn fake_helper_script_as(dir: &Path, log: &Path, fail: bool) -> PathBuf {
    let path = dir.join("fake-copyin");
    let exe = std::env::current_exe().unwrap();
    std::fs::write(
        &path,
        format!(
            "#!/bin/bash\nexport GPUCR_FAKE_HELPER_LOG={}\n{}exec {} --exact \
             fastpath::tests::helpers::fake_copyin_helper --test-threads=1 -q >/dev/null\n",
            log.display(),
            if fail {
                "export GPUCR_FAKE_HELPER_FAIL=1\n"
            } else {
                ""
            },
            exe.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

/// Warm with the image sends each helper its job at once (it pins while the driver
/// restores the process); the copy-in only sends the memory. What a helper says it
/// copied is not trusted: one that did not copy fails the copy-in's device check. A
/// job for another image is not used: the copy-in stages everything.
#[test]
fn warm_with_the_image_sends_the_jobs_ahead_and_helpers_are_checked_on_the_device() {
    let Some(root) = tmpfs_dir() else { return };
    let bin = tempfile::tempdir().unwrap();
    let log = bin.path().join("log");
    let helper = fake_helper_script(bin.path(), &log);
    let log_lines = || std::fs::read_to_string(&log).unwrap_or_default();
    let wait_for = |what: &str, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while log_lines().lines().filter(|l| l.starts_with(what)).count() < n {
            assert!(Instant::now() < deadline, "no {what} in {:?}", log_lines());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let s = with_device_hash(FastPathOptions {
        copy_in_helpers: 2,
        helper_path: Some(helper),
        helper_share: Some(0.5),
        ..pipelined()
    });
    s.driver.set_device_ordinal(Some(0));
    let expected = populate_hashable(&s);
    s.fast.freeze().unwrap();
    let (image, other) = (root.path().join("img"), root.path().join("other"));
    s.fast.copy_out(&image, None).unwrap();
    s.fast.copy_out(&other, None).unwrap();

    // A job for another image: not used.
    s.fast.release(false).unwrap();
    let warm = s.fast.warm(Some(&other)).unwrap();
    assert_eq!(warm.helpers, 2);
    assert!(warm.ahead_bytes > 0, "{warm:?}");
    wait_for("job", 2);
    s.fast.remap().unwrap();
    let report = s.fast.copy_in(&image).unwrap();
    assert!(report.helpers.is_empty(), "{report:?}");
    assert!(!log_lines().contains("go"), "{}", log_lines());
    s.fast.thaw().unwrap();
    check_memory(&s.driver, &s.allocator, &expected);

    // The jobs arrive at Warm, before the memory exists again; the Go at the copy-in.
    std::fs::remove_file(&log).unwrap();
    s.fast.freeze().unwrap();
    s.fast.release(false).unwrap();
    let warm = s.fast.warm(Some(&image)).unwrap();
    wait_for("job", 2);
    let bytes: u64 = log_lines()
        .lines()
        .map(|l| l.split(' ').nth(2).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(bytes, warm.ahead_bytes);
    s.fast.remap().unwrap();
    let err = s.fast.copy_in(&image).unwrap_err();
    assert!(
        matches!(err, FastPathError::DeviceCheck { .. }),
        "a helper that copied nothing is caught: {err}"
    );
    assert_eq!(log_lines().matches("go ").count(), 2, "{}", log_lines());
}

/// A restore's helpers come from the shim: started before the hook answers, sent jobs
/// planned from the image alone (`plan_image_jobs`), and handed over at Warm. The
/// copy-in sends them only the Go, with the memory's mapped sizes (which the shim
/// cannot know); a helper that fails has its share staged, and the memory is exact.
#[test]
fn helpers_the_shim_started_are_taken_over_and_a_failed_ones_share_is_staged() {
    use crate::helper::{helper_command, plan_image_jobs, write_job, HelperDevice, ENV_SOCKET_FD};
    let Some(root) = tmpfs_dir() else { return };
    let bin = tempfile::tempdir().unwrap();
    let log = bin.path().join("log");
    let helper = fake_helper_script_as(bin.path(), &log, true);
    let s = with_device_hash(pipelined());
    let expected = populate_hashable(&s);
    s.fast.freeze().unwrap();
    let image = root.path().join("img");
    s.fast.copy_out(&image, None).unwrap();
    s.fast.release(false).unwrap();

    // The shim's part: jobs from the image, helpers started, jobs written.
    let reader = ImageReader::open(&image).unwrap();
    let pid = reader.allocations()[0].tags.pid;
    let jobs = plan_image_jobs(&reader, pid, 0.5, 2).unwrap();
    assert_eq!(jobs.len(), 2);
    let mut children = Vec::new();
    let (mut descs, mut socks) = (Vec::new(), Vec::new());
    for (job, desc) in jobs {
        let uuid = HelperDevice::Uuid("GPU-00000000-0000-0000-0000-000000000000".into());
        let (mut cmd, mut ours, theirs) = helper_command(&helper, &uuid).unwrap();
        assert!(cmd.get_envs().any(|(k, _)| k == ENV_SOCKET_FD));
        children.push(cmd.spawn().unwrap());
        drop(theirs);
        write_job(&mut ours, &job, &reader.data_files()).unwrap();
        descs.push(desc);
        socks.push(OwnedFd::from(ours));
    }
    let bytes: u64 = descs.iter().map(|d| d.bytes).sum();
    let warm = s.fast.adopt_helpers(descs, socks).unwrap();
    assert_eq!((warm.helpers, warm.ahead_bytes), (2, bytes));
    // As in a restore, where they have had CRIU's restore to get ready.
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .count()
        < 2
    {
        assert!(Instant::now() < deadline, "the helpers took no jobs");
        std::thread::sleep(Duration::from_millis(20));
    }

    s.fast.remap().unwrap();
    let report = s.fast.copy_in(&image).unwrap();
    // Both got their Go with the mapped sizes (the driver's granularity), then failed.
    let mapped: Vec<u64> = s.allocator.table().iter().map(|a| a.mapped_size).collect();
    let lines = std::fs::read_to_string(&log).unwrap();
    let gos: Vec<&str> = lines.lines().filter(|l| l.starts_with("go ")).collect();
    assert_eq!(gos.len(), 2, "{lines}");
    for go in gos {
        let sizes = go.split_once('[').unwrap().1.trim_end_matches(']');
        for size in sizes.split(", ") {
            assert!(mapped.contains(&size.parse().unwrap()), "{go} {mapped:?}");
        }
    }
    assert_eq!(report.helpers.len(), 2, "{report:?}");
    assert!(
        report
            .helpers
            .iter()
            .all(|h| h.error.as_deref() == Some("told to fail")),
        "{report:?}"
    );
    s.fast.thaw().unwrap();
    check_memory(&s.driver, &s.allocator, &expected);
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
}
