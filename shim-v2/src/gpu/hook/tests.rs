use super::*;
use crate::gpu::restore_helpers::RestoreHelpers;
use gpucr_hook::protocol::CheckpointState;
use std::sync::Arc;

use gpucr_hook::driver::{DriverCall, VmmDriver};
use gpucr_hook::fake::FakeDriver;
use gpucr_hook::fastpath::FastPathOptions;
use gpucr_hook::gate::GateState;
use gpucr_hook::hook::Hook;

/// A CUDA process stand-in: a real hook over the fake driver, serving its socket.
struct FakeProcess {
    hook: Hook<FakeDriver>,
    driver: Arc<FakeDriver>,
    data: Vec<(u64, Vec<u8>)>,
    process: HookProcess,
    _sockets: tempfile::TempDir,
}

fn fake(ns_pid: u32) -> FakeProcess {
    fake_with(ns_pid, 0)
}

/// A fake process whose snapshots must leave `headroom` bytes of its device free.
fn fake_with(ns_pid: u32, headroom: u64) -> FakeProcess {
    let driver = Arc::new(FakeDriver::default());
    let opts = FastPathOptions {
        pid: Some(ns_pid),
        freeze_timeout: Duration::from_secs(10),
        snapshot_headroom: headroom,
        ..FastPathOptions::default()
    };
    let hook = Hook::new(driver.clone(), opts).unwrap();
    let data = (0..3u64)
        .map(|i| {
            let bytes: Vec<u8> = (0..50_000 + i * 1000)
                .map(|b| (b * (i + 3)) as u8)
                .collect();
            let va = hook.alloc(bytes.len() as u64).unwrap();
            driver.copy_from_host(va, &bytes).unwrap();
            (va, bytes)
        })
        .collect();
    let sockets = tempfile::tempdir().unwrap();
    let socket = hook.serve(sockets.path()).unwrap();
    FakeProcess {
        hook,
        driver,
        data,
        process: HookProcess {
            host_pid: ns_pid + 100_000,
            ns_pid,
            socket,
        },
        _sockets: sockets,
    }
}

impl FakeProcess {
    /// Running, with every byte of its device memory as it was.
    fn assert_intact(&self) {
        assert_eq!(self.hook.state(), CheckpointState::Running);
        assert_eq!(self.hook.gate().state(), GateState::Running);
        for (va, want) in &self.data {
            let mut got = vec![0u8; want.len()];
            self.driver.copy_to_host(*va, &mut got).unwrap();
            assert!(got == *want, "device memory at {va:#x} changed");
        }
    }
}

/// The restore's copy-in of `record` from `image`, with no helpers started.
fn restore_without_helpers(socket_dir: &Path, image: &Path, record: &HookRecord) -> Result<usize> {
    copy_in_restored(
        "c",
        socket_dir,
        image,
        record,
        &mut RestoreHelpers::default(),
    )
}

/// The hook's part of a checkpoint of `p` alone, into `image`.
fn checkpoint_one(p: &FakeProcess, image: &Path, keep: bool, running: bool) -> HookCheckpoint {
    copy_out("c", std::slice::from_ref(&p.process), image, keep, running).unwrap()
}

#[test]
fn ns_pid_is_the_innermost() {
    assert_eq!(parse_ns_pid("Name:\tx\nNSpid:\t4242\t7\t1\n"), Some(1));
    assert_eq!(parse_ns_pid("NSpid:\t99\n"), Some(99));
    assert_eq!(parse_ns_pid("Pid:\t99\n"), None);
    assert_eq!(ns_pid(std::process::id()), Some(std::process::id()));
}

#[test]
fn find_keeps_processes_with_a_socket() {
    let dir = tempfile::tempdir().unwrap();
    let me = std::process::id();
    assert!(find(dir.path(), &[me]).is_empty());
    std::fs::write(socket_path(dir.path(), me), b"").unwrap();
    let found = find(dir.path(), &[me, u32::MAX - 1]);
    assert_eq!(found.len(), 1);
    assert_eq!((found[0].host_pid, found[0].ns_pid), (me, me));
}

#[test]
fn checkpoint_moves_memory_and_gives_it_back() {
    let procs = [fake(11), fake(12)];
    let image = tempfile::tempdir().unwrap();
    let targets: Vec<_> = procs.iter().map(|p| p.process.clone()).collect();
    let cp = copy_out("c", &targets, image.path(), false, false).unwrap();
    for p in &procs {
        assert_eq!(p.hook.state(), CheckpointState::Released);
        assert!(HookRecord::image_of(image.path(), p.process.ns_pid).is_dir());
    }
    let record = cp.record();
    assert!(record.injected && record.fallbacks.is_empty());
    assert_eq!(record.processes.len(), 2);
    assert_eq!(record.processes[0].copy_out_bytes, 50_000 + 51_000 + 52_000);
    assert_eq!(record.processes[0].allocations, 3);
    record.save(image.path()).unwrap();
    let loaded = HookRecord::load(image.path()).unwrap().unwrap();
    assert_eq!(loaded, record);
    loaded.validate(image.path()).unwrap();
    // After the dump (leave-running), or a failure before it: memory back, running.
    cp.give_back().unwrap();
    procs.iter().for_each(FakeProcess::assert_intact);
}

/// Flips a byte in the middle of the first data file of process `ns_pid`'s image.
fn damage_image(image: &Path, ns_pid: u32) {
    let dir = HookRecord::image_of(image, ns_pid);
    let data = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| std::fs::metadata(p).unwrap().len() > 64 && !p.ends_with("manifest.json"))
        .expect("a data file");
    let mut bytes = std::fs::read(&data).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&data, bytes).unwrap();
}

#[test]
fn leave_running_keeps_the_memory_on_the_gpu_and_reattaches_it() {
    let p = fake(13);
    let image = tempfile::tempdir().unwrap();
    let cp = checkpoint_one(&p, image.path(), true, false);
    assert_eq!(p.hook.state(), CheckpointState::Released);
    let record = cp.record();
    assert_eq!(record.processes[0].kept, 3, "{record:?}");
    // The image is complete all the same (a restore elsewhere needs it).
    record.validate(image.path()).unwrap();
    // Held by the shim's fds: still on the "GPU" though the hook released it.
    assert!(p.driver.physical_bytes() >= 3 * 50_000);
    // Given back without a copy-in: a damaged image does not matter.
    damage_image(image.path(), 13);
    cp.give_back().unwrap();
    p.assert_intact();
}

#[test]
fn kept_memory_that_cannot_be_reattached_is_copied_in() {
    let p = fake(14);
    let image = tempfile::tempdir().unwrap();
    let cp = checkpoint_one(&p, image.path(), true, false);
    p.driver.fail_nth(DriverCall::Import, 1);
    cp.give_back().unwrap();
    p.assert_intact();

    // A driver that cannot export: nothing kept, the usual Remap and CopyIn.
    let q = fake(15);
    q.driver.set_no_export(true);
    let cp = checkpoint_one(&q, image.path(), true, false);
    assert_eq!(cp.record().processes[0].kept, 0);
    cp.give_back().unwrap();
    q.assert_intact();
}

#[test]
fn unsupported_memory_or_a_dead_socket_leaves_the_process_to_the_driver() {
    let odd = fake(21);
    odd.hook
        .record_unsupported(gpucr_hook::alloc::UnsupportedKind::Managed, 0x10_0000, 4096);
    let good = fake(22);
    let dead = HookProcess {
        host_pid: 23,
        ns_pid: 23,
        socket: PathBuf::from("/nonexistent/hook-23.sock"),
    };
    let image = tempfile::tempdir().unwrap();
    let targets = [odd.process.clone(), dead, good.process.clone()];
    let cp = copy_out("c", &targets, image.path(), false, false).unwrap();
    let record = cp.record();
    assert_eq!(record.processes.len(), 1);
    assert_eq!(record.processes[0].ns_pid, 22);
    assert_eq!(record.fallbacks.len(), 2);
    assert!(
        record.fallbacks[0].reason.contains("cannot move"),
        "{record:?}"
    );
    assert_eq!(odd.hook.state(), CheckpointState::Running);
    assert!(!HookRecord::image_of(image.path(), 21).exists());
    cp.give_back().unwrap();
    good.assert_intact();
}

#[test]
fn a_failed_copy_out_or_release_thaws_and_falls_back() {
    let image = tempfile::tempdir().unwrap();
    let copy_fails = fake(31);
    copy_fails.driver.fail_next(DriverCall::CopyToHost);
    let release_fails = fake(32);
    release_fails.driver.fail_nth(DriverCall::Release, 1);
    let targets = [copy_fails.process.clone(), release_fails.process.clone()];
    let cp = copy_out("c", &targets, image.path(), false, false).unwrap();
    let record = cp.record();
    assert!(record.processes.is_empty(), "{record:?}");
    assert_eq!(record.fallbacks.len(), 2);
    assert!(record.fallbacks[1].reason.contains("Release"), "{record:?}");
    copy_fails.assert_intact();
    release_fails.assert_intact();
    // Nothing of theirs is left for a restore to find.
    assert!(!HookRecord::image_of(image.path(), 31).exists());
    assert!(!HookRecord::image_of(image.path(), 32).exists());
    cp.give_back().unwrap();
}

#[test]
fn give_back_tries_every_process_and_reports_the_stranded_one() {
    let procs = [fake(41), fake(42)];
    let image = tempfile::tempdir().unwrap();
    let targets: Vec<_> = procs.iter().map(|p| p.process.clone()).collect();
    let cp = copy_out("c", &targets, image.path(), false, false).unwrap();
    procs[0].driver.fail_next(DriverCall::Create);
    let err = cp.give_back().unwrap_err();
    assert!(matches!(err, HookError::Stranded { .. }), "{err}");
    assert!(err.to_string().contains("kill it"), "{err}");
    procs[1].assert_intact();
    assert_eq!(procs[0].hook.state(), CheckpointState::Released);
}

#[test]
fn a_restored_process_gets_its_memory_from_the_image() {
    let me = std::process::id();
    let p = fake(me);
    let image = tempfile::tempdir().unwrap();
    let cp = checkpoint_one(&p, image.path(), false, false);
    let record = cp.record();
    // As after CRIU's restore: the hook answers in the new socket directory, Released.
    let socket_dir = p.process.socket.parent().unwrap();
    drop(cp);
    let n = restore_without_helpers(socket_dir, image.path(), &record).unwrap();
    assert_eq!(n, 1);
    p.assert_intact();
    // Not Released any more: a second restore of the same process is refused.
    assert!(restore_without_helpers(socket_dir, image.path(), &record).is_err());
}

#[test]
fn a_damaged_or_missing_hook_image_is_refused() {
    let p = fake(51);
    let image = tempfile::tempdir().unwrap();
    let cp = checkpoint_one(&p, image.path(), false, false);
    let record = cp.record();
    cp.give_back().unwrap();
    record.validate(image.path()).unwrap();
    damage_image(image.path(), 51);
    let dir = HookRecord::image_of(image.path(), 51);
    let err = record.validate(image.path()).unwrap_err();
    assert!(err.to_string().contains("damaged"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(record.validate(image.path()).is_err());

    std::fs::write(HookRecord::file_path(image.path()), b"{").unwrap();
    assert!(HookRecord::load(image.path()).is_err());
    assert!(HookRecord::load(tempfile::tempdir().unwrap().path())
        .unwrap()
        .is_none());
}

#[test]
fn leave_running_snapshots_the_memory_and_writes_the_image_after_the_thaw() {
    // Named by this process's pid, as a restored process's socket is found.
    let me = std::process::id();
    let p = fake(me);
    let image = tempfile::tempdir().unwrap();
    let mut cp = checkpoint_one(&p, image.path(), true, true);
    assert_eq!(p.hook.state(), CheckpointState::Snapshotted);
    let record = cp.record();
    assert_eq!(record.processes[0].kept, 3, "{record:?}");
    assert!(
        !HookRecord::image_of(image.path(), me).exists(),
        "not written yet"
    );
    assert!(!cp.images_complete());
    cp.give_back_and_write().unwrap();
    assert!(cp.images_complete());
    p.assert_intact();
    let record = cp.record();
    assert_eq!(record.processes[0].copy_out_bytes, 50_000 + 51_000 + 52_000);
    record.validate(image.path()).unwrap();
    // A process restored from it (Snapshotted in the dump, no fds) copies it in.
    let again = tempfile::tempdir().unwrap();
    let cp2 = checkpoint_one(&p, again.path(), true, true);
    drop(cp2);
    assert_eq!(p.hook.state(), CheckpointState::Snapshotted);
    let socket_dir = p.process.socket.parent().unwrap();
    restore_without_helpers(socket_dir, image.path(), &record).unwrap();
    p.assert_intact();
}

#[test]
fn without_room_for_a_snapshot_the_memory_is_copied_out_while_frozen() {
    let p = fake_with(17, 1 << 40);
    let image = tempfile::tempdir().unwrap();
    let mut cp = checkpoint_one(&p, image.path(), true, true);
    assert_eq!(p.hook.state(), CheckpointState::Released);
    let record = cp.record();
    assert_eq!(record.processes[0].snapshot_ms, 0);
    assert_eq!(record.processes[0].kept, 3);
    record.validate(image.path()).unwrap();
    cp.give_back_and_write().unwrap();
    assert!(cp.images_complete());
    p.assert_intact();
}

#[test]
fn a_failed_checkpoint_drops_the_snapshot_and_a_failed_write_is_reported() {
    let image = tempfile::tempdir().unwrap();
    // The dump failed: memory back, snapshot dropped, nothing written.
    let p = fake(18);
    let cp = checkpoint_one(&p, image.path(), true, true);
    cp.give_back().unwrap();
    p.assert_intact();
    assert!(!HookRecord::image_of(image.path(), 18).exists());
    // The write fails: the process runs on, the checkpoint is incomplete.
    let q = fake(19);
    let mut cp = checkpoint_one(&q, image.path(), true, true);
    q.driver.fail_next(DriverCall::CopyToHost);
    assert!(cp.give_back_and_write().is_err());
    assert!(!cp.images_complete());
    q.assert_intact();
    // The snapshot cannot be mapped back: stranded, said so.
    let r = fake(20);
    let mut cp = checkpoint_one(&r, image.path(), true, true);
    r.driver.fail_next(DriverCall::Import);
    let err = cp.give_back_and_write().unwrap_err();
    assert!(matches!(err, HookError::Stranded { .. }), "{err}");
    assert!(!cp.images_complete());
}

#[test]
fn a_copy_out_into_tmpfs_is_prepared_while_a_running_task_runs() {
    let shm = Path::new("/dev/shm");
    if !gpu_state::image::is_tmpfs(shm) {
        eprintln!("skipped: /dev/shm is not tmpfs");
        return;
    }
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    // Exit (no keep) of a running task: prepared where the image is on tmpfs; never for
    // a paused task (it must not run before its dump).
    for (image, running, prepared) in [
        (tempfile::tempdir_in(shm).unwrap(), true, true),
        (tempfile::tempdir_in(shm).unwrap(), false, false),
        (disk, true, false),
    ] {
        let p = fake(31);
        let cp = checkpoint_one(&p, image.path(), false, running);
        let record = cp.record();
        assert_eq!(record.processes[0].prepared, prepared, "{record:?}");
        record.validate(image.path()).unwrap();
        cp.give_back().unwrap();
        p.assert_intact();
        // Nothing of the Prepare is left: one image directory, nothing registered.
        let names: Vec<_> =
            std::fs::read_dir(HookRecord::image_of(image.path(), 31).parent().unwrap())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
        assert_eq!(names, [std::ffi::OsString::from("31")]);
        assert_eq!(p.driver.registered_ranges(), 0);
    }
}

/// Not a test of its own: the body of a fake `gpucr-copyin` when this test binary is
/// started as one (see the restore test below). It logs its job and its Go, then says
/// Failed, so the hook stages its share.
#[test]
fn fake_restore_helper() {
    use gpucr_hook::helper::{helper_socket, next_go, next_job, say, HelperMsg, ENV_DEVICE_UUID};
    use std::io::Write;
    let Some(log) = std::env::var_os("GPUCR_FAKE_RESTORE_HELPER_LOG") else {
        return;
    };
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .unwrap();
    let uuid = std::env::var(ENV_DEVICE_UUID).unwrap_or_default();
    let mut sock = helper_socket().unwrap();
    say(&mut sock, &HelperMsg::Ready { init_s: 0.0 }).unwrap();
    let (job, files) = next_job(&mut sock).unwrap().unwrap();
    // One write per line: the helpers append to one log at once.
    let line = format!("job {} files={} {uuid}\n", job.pieces.len(), files.len());
    log.write_all(line.as_bytes()).unwrap();
    let (memory, sizes) = next_go(&mut sock, &job).unwrap().unwrap();
    let line = format!("go {} {sizes:?}\n", memory.len());
    log.write_all(line.as_bytes()).unwrap();
    let failed = HelperMsg::Failed {
        message: "fake helper".into(),
    };
    say(&mut sock, &failed).unwrap();
    let _ = next_job(&mut sock);
    std::process::exit(0);
}

/// A restore: the shim starts copy-in helpers for the image before CRIU (here: before
/// the copy-in), sends them their jobs, and hands them to the restored process's hook
/// with Warm; the hook sends each its Go at the copy-in. These fake helpers fail after
/// their Go, so the hook stages their share: the memory is exact either way, and the
/// helpers are gone after `finish`.
#[test]
fn a_restore_hands_the_shims_helpers_to_the_hook() {
    let shm = Path::new("/dev/shm");
    if !gpu_state::image::is_tmpfs(shm) {
        eprintln!("skipped: /dev/shm is not tmpfs");
        return;
    }
    let me = std::process::id();
    let p = fake(me);
    p.driver.set_device_hash(true);
    let image = tempfile::tempdir_in(shm).unwrap();
    let cp = checkpoint_one(&p, image.path(), false, false);
    let record = cp.record();
    drop(cp);
    assert_eq!(p.hook.state(), CheckpointState::Released);

    let bin = tempfile::tempdir().unwrap();
    let log = bin.path().join("log");
    let script = bin.path().join("gpucr-copyin");
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\nexport GPUCR_FAKE_RESTORE_HELPER_LOG={}\nexec {} --exact \
             gpu::hook::tests::fake_restore_helper --test-threads=1 -q >/dev/null\n",
            log.display(),
            std::env::current_exe().unwrap().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let uuid = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
    let mut helpers = RestoreHelpers::default();
    helpers.start_processes(
        image.path(),
        &record,
        2,
        &script,
        uuid,
        &crate::reaper::Spawner::Plain,
    );
    assert_eq!(helpers.len(), 2);
    let lines = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    while lines().lines().filter(|l| l.starts_with("job")).count() < 2 {
        assert!(Instant::now() < deadline, "no jobs: {}", lines());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(lines().lines().all(|l| l.ends_with(uuid)), "{}", lines());

    let socket_dir = p.process.socket.parent().unwrap();
    copy_in_restored("c", socket_dir, image.path(), &record, &mut helpers).unwrap();
    let gos = lines().lines().filter(|l| l.starts_with("go ")).count();
    assert_eq!(gos, 2, "{}", lines());
    p.assert_intact();
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(helpers.finish());
}
