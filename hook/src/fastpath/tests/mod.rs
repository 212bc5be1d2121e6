use super::dma::plan_windows;
use super::*;
use crate::alloc::UnsupportedKind;
use crate::control::{socket_path, ControlClient, ControlServer, Controller};
use crate::driver::DriverCall;
use crate::fake::FakeDriver;
use crate::gate::GateState;
use crate::protocol::{Outcome, Reply, Request};
use gpu_state::image::{Compression, ImageOptions, ImageReader, ImageWriter};
use std::time::{Duration, Instant};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

const G: u64 = 64 << 10;
const CHUNK: usize = 4096;

struct Setup {
    driver: Arc<FakeDriver>,
    allocator: Arc<Allocator<FakeDriver>>,
    gate: Arc<Gate>,
    fast: FastPath<FakeDriver>,
}

fn opts() -> FastPathOptions {
    FastPathOptions {
        image: ImageOptions {
            chunk_size: CHUNK,
            compression: Compression::Zstd { level: 1 },
            threads: 2,
            max_in_flight: 2,
        },
        freeze_timeout: Duration::from_secs(10),
        pid: Some(4242),
        streams: 2,
        copy_in_staging: 2 * CHUNK,
        read_threads: 2,
        map_reads: MapReads::Tmpfs,
        pin: true,
        direct: false,
        direct_window: 1 << 30,
        prepare: true,
        // The fake hashes on the "device" only when a test switches it on.
        device_hash: true,
        keep: true,
        snapshot: true,
        snapshot_headroom: 0,
        copy_in_helpers: 0,
        helper_path: None,
        helper_share: None,
    }
}

fn setup() -> Setup {
    setup_with(opts())
}

fn setup_with(opts: FastPathOptions) -> Setup {
    let driver = Arc::new(FakeDriver::new(G, 256 * G));
    let allocator = Arc::new(Allocator::new(driver.clone()).unwrap());
    let gate = Arc::new(Gate::new());
    let fast = FastPath::new(allocator.clone(), gate.clone(), opts);
    Setup {
        driver,
        allocator,
        gate,
        fast,
    }
}

/// Deterministic, non-repeating-per-allocation contents (with a zero stretch).
fn pattern(seed: u64, len: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|i| {
            if (CHUNK as u64..2 * CHUNK as u64).contains(&i) {
                return 0;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn read(driver: &FakeDriver, va: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0; len as usize];
    driver.copy_to_host(va, &mut out).unwrap();
    out
}

/// Allocations of awkward sizes, filled; returns (va, contents).
fn populate(s: &Setup) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, size) in [1u64, 4095, 4096, 3 * CHUNK as u64 + 17, G + 1, 5 * G]
        .into_iter()
        .enumerate()
    {
        let va = s.allocator.alloc(size).unwrap();
        let data = pattern(i as u64, size);
        s.driver.copy_from_host(va, &data).unwrap();
        out.push((va, data));
    }
    let (va, pitch) = s.allocator.alloc_pitch(1000, 7, 4).unwrap();
    let data = pattern(99, pitch * 7);
    s.driver.copy_from_host(va, &data).unwrap();
    out.push((va, data));
    out
}

fn check(s: &Setup, expected: &[(u64, Vec<u8>)]) {
    check_memory(&s.driver, &s.allocator, expected);
}

fn check_memory(
    driver: &FakeDriver,
    allocator: &Allocator<FakeDriver>,
    expected: &[(u64, Vec<u8>)],
) {
    for (va, data) in expected {
        let alloc = allocator.get(*va).expect("allocation at its old VA");
        assert_eq!(alloc.state, AllocState::Mapped);
        assert_eq!(&read(driver, *va, data.len() as u64), data, "{va:#x}");
    }
}

#[test]
fn round_trip_keeps_contents_and_addresses_with_bounded_staging() {
    let s = setup();
    let expected = populate(&s);
    let vas_before = s.allocator.addresses();
    let physical = s.driver.physical_bytes();
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("gpu-state");

    s.fast.freeze().unwrap();
    assert_eq!(s.gate.state(), GateState::Frozen);
    let out = s.fast.copy_out(&image, None).unwrap();
    assert_eq!(out.allocations, expected.len());
    assert_eq!(
        out.bytes,
        expected.iter().map(|(_, d)| d.len() as u64).sum::<u64>()
    );
    assert!(out.peak_staging_bytes > 0 && out.peak_staging_bytes <= 2 * CHUNK as u64);

    let (released, kept) = s.fast.release(false).unwrap();
    assert!(kept.is_empty() && released.held.is_empty());
    assert_eq!(released.bytes, physical);
    assert_eq!(s.driver.physical_bytes(), 0, "all device memory released");
    assert_eq!(s.driver.reservations(), expected.len(), "VA kept");

    let remapped = s.fast.remap().unwrap();
    assert_eq!(remapped.bytes, physical);
    let (va, _) = &expected[0];
    assert_eq!(
        read(&s.driver, *va, 1),
        [FakeDriver::FILL],
        "new memory before copy-in"
    );
    let copied = s.fast.copy_in(&image).unwrap();
    assert_eq!(copied.bytes, out.bytes);
    assert_eq!(
        copied.staging_bytes,
        2 * CHUNK as u64,
        "two buffers of the image's chunk size"
    );
    s.fast.thaw().unwrap();

    assert_eq!(s.allocator.addresses(), vas_before);
    check(&s, &expected);
    assert_eq!(s.gate.state(), GateState::Running);
}

/// A full copy-out into `<root>/full`, thaw, one byte of allocation `which` flipped at
/// `byte` (in `expected` too), freeze again: ready for a copy-out against `full`.
/// Returns the temporary root, `full` and the path for the delta image.
fn full_image_then_change(
    s: &Setup,
    expected: &mut [(u64, Vec<u8>)],
    which: usize,
    byte: usize,
) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let (full, delta) = (root.path().join("full"), root.path().join("delta"));
    s.fast.freeze().unwrap();
    s.fast.copy_out(&full, None).unwrap();
    s.fast.thaw().unwrap();
    let (va, data) = &mut expected[which];
    data[byte] ^= 0xff;
    s.driver.copy_from_host(*va, data).unwrap();
    s.fast.freeze().unwrap();
    (root, full, delta)
}

#[test]
fn delta_image_against_a_parent_restores_too() {
    let s = setup();
    let mut expected = populate(&s);
    let (_root, full, delta) = full_image_then_change(&s, &mut expected, 3, 5);
    s.fast.copy_out(&delta, Some(&full)).unwrap();
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    s.fast.copy_in(&delta).unwrap();
    s.fast.thaw().unwrap();
    check(&s, &expected);
}

#[test]
fn new_work_waits_while_frozen() {
    let s = setup();
    s.fast.freeze().unwrap();
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let _guard = s.gate.enter();
            s.allocator.alloc(10).unwrap();
            done.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !done.load(Ordering::SeqCst),
            "allocation passed a frozen gate"
        );
        s.fast.thaw().unwrap();
    });
    assert!(done.load(Ordering::SeqCst));
}

#[test]
fn unsupported_memory_refuses_the_fast_path() {
    let s = setup();
    populate(&s);
    s.allocator
        .record_unsupported(UnsupportedKind::Managed, 0x1000, 4096);
    s.fast.freeze().unwrap();
    let root = tempfile::tempdir().unwrap();
    let err = s.fast.copy_out(&root.path().join("img"), None).unwrap_err();
    assert!(
        matches!(err, FastPathError::UnsupportedMemory(ref v) if v.len() == 1),
        "{err}"
    );
    assert!(matches!(
        s.fast.release(false),
        Err(FastPathError::UnsupportedMemory(_))
    ));
    assert!(s.driver.physical_bytes() > 0, "nothing released");
}

#[test]
fn driver_failure_during_copy_out_publishes_nothing() {
    let s = setup();
    populate(&s);
    s.fast.freeze().unwrap();
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.driver.fail_next(DriverCall::CopyToHost);
    let err = s.fast.copy_out(&image, None).unwrap_err();
    assert!(matches!(err, FastPathError::Driver(ref e) if e.call == DriverCall::CopyToHost));
    assert!(!image.exists(), "a failed copy-out must not leave an image");
    s.fast.copy_out(&image, None).unwrap();
}

#[test]
fn copy_in_refuses_an_image_that_does_not_match() {
    let s = setup();
    let expected = populate(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("img");
    s.fast.freeze().unwrap();
    s.fast.copy_out(&image, None).unwrap();
    s.fast.thaw().unwrap();

    // One allocation more than the image has.
    let extra = s.allocator.alloc(100).unwrap();
    let err = s.fast.copy_in(&image).unwrap_err();
    assert!(
        matches!(err, FastPathError::NotInImage { va } if va == extra),
        "{err}"
    );
    s.allocator.free(extra).unwrap();
    // One allocation fewer.
    let (gone, _) = expected[0];
    s.allocator.free(gone).unwrap();
    let err = s.fast.copy_in(&image).unwrap_err();
    assert!(
        matches!(err, FastPathError::NotTracked { va } if va == gone),
        "{err}"
    );
    // Released memory cannot be copied into.
    let (va, _) = expected[1];
    s.allocator.release(va).unwrap();
    let root2 = tempfile::tempdir().unwrap();
    assert!(matches!(
        s.fast.copy_out(&root2.path().join("x"), None),
        Err(FastPathError::NotMapped { .. })
    ));
}

#[test]
fn failed_synchronize_leaves_the_gate_running() {
    let s = setup();
    s.driver.fail_next(DriverCall::Synchronize);
    assert!(matches!(s.fast.freeze(), Err(FastPathError::Driver(_))));
    assert_eq!(s.gate.state(), GateState::Running);
}

#[test]
fn checkpoint_sequence_over_the_control_socket() {
    let s = setup();
    let expected = populate(&s);
    let root = tempfile::tempdir().unwrap();
    let image = root.path().join("gpu-state");
    let path = socket_path(root.path(), 4242);
    let Setup {
        driver,
        allocator,
        gate,
        fast,
    } = s;
    let controller = Arc::new(Mutex::new(Controller::new(fast)));
    ControlServer::bind(&path)
        .unwrap()
        .spawn(controller.clone())
        .unwrap();
    let mut client = ControlClient::connect(&path).unwrap();
    let requests = [
        Request::Freeze,
        Request::CopyOut {
            image_dir: image.clone(),
            parent: None,
        },
        Request::Release { keep: false },
        Request::Status,
        Request::Remap,
        Request::CopyIn {
            image_dir: image.clone(),
        },
        Request::Thaw,
    ];
    for req in &requests {
        let reply = client.call(req).unwrap();
        let Reply::Ok(outcome) = reply else {
            panic!("{req:?}: {reply:?}");
        };
        if let Outcome::Status(status) = outcome {
            assert_eq!(status.state, crate::protocol::CheckpointState::Released);
            assert_eq!(status.gate, GateState::Frozen);
            assert_eq!(status.released, expected.len());
            assert_eq!(driver.physical_bytes(), 0);
        }
    }
    check_memory(&driver, &allocator, &expected);
    assert_eq!(gate.state(), GateState::Running);
}

#[test]
fn a_release_failing_half_way_is_undone_from_the_image() {
    let s = setup();
    let expected = populate(&s);
    let physical = s.driver.physical_bytes();
    let root = tempfile::tempdir().unwrap();
    s.fast.freeze().unwrap();
    s.fast.copy_out(&root.path().join("img"), None).unwrap();
    s.driver.fail_nth(DriverCall::Release, 3);
    let err = s.fast.release(false).unwrap_err();
    assert!(matches!(err, FastPathError::ReleaseFailed { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("4 released allocation(s) restored"),
        "{err}"
    );
    // Everything mapped again with its contents (the failed one's handle is leaked).
    check(&s, &expected);
    assert!(s.driver.physical_bytes() >= physical);
    s.fast.thaw().unwrap();
}

#[test]
fn thaw_is_refused_while_memory_is_released() {
    let s = setup();
    let expected = populate(&s);
    s.fast.freeze().unwrap();
    s.allocator.release(expected[0].0).unwrap();
    let err = s.fast.thaw().unwrap_err();
    assert!(
        matches!(err, FastPathError::ReleasedMemory { count: 1 }),
        "{err}"
    );
    assert_eq!(s.gate.state(), GateState::Frozen);
    // Without an image there is nothing to undo a failed release from.
    s.driver.fail_next(DriverCall::Release);
    let err = s.fast.release(false).unwrap_err();
    assert!(err.to_string().contains("no copy-out image"), "{err}");
}

/// Options that make the pipeline deep: 3 streams, 6 staging buffers, no compression.
fn pipelined() -> FastPathOptions {
    FastPathOptions {
        image: ImageOptions {
            chunk_size: CHUNK,
            compression: Compression::None,
            threads: 2,
            max_in_flight: 6,
        },
        streams: 3,
        copy_in_staging: 5 * CHUNK,
        read_threads: 3,
        ..opts()
    }
}

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

fn chunks_of(expected: &[(u64, Vec<u8>)]) -> usize {
    expected.iter().map(|(_, d)| d.len().div_ceil(CHUNK)).sum()
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

#[test]
fn options_come_from_the_environment() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let d = FastPathOptions::from_env_with(env(&[])).unwrap();
    assert_eq!(d.image.compression, Compression::None);
    assert_eq!(d.image.chunk_size, 16 << 20);
    assert_eq!(d.image.max_in_flight, 32);
    assert_eq!((d.streams, d.copy_in_staging, d.pin), (4, 512 << 20, true));
    let o = FastPathOptions::from_env_with(env(&[
        (ENV_COMPRESSION, "zstd:3"),
        (ENV_CHUNK_MIB, "64"),
        (ENV_STAGING_MIB, "256"),
        (ENV_THREADS, "12"),
        (ENV_STREAMS, "8"),
        (ENV_PIN, "0"),
    ]))
    .unwrap();
    assert_eq!(o.image.compression, Compression::Zstd { level: 3 });
    assert_eq!((o.image.chunk_size, o.image.max_in_flight), (64 << 20, 9));
    assert_eq!((o.image.threads, o.read_threads, o.streams), (12, 12, 8));
    assert!(!o.pin);
    assert!(!d.direct && d.direct_window == 2048 << 20);
    // The helpers' share: by mode unless set.
    assert_eq!((d.copy_in_helpers, d.helper_share), (0, None));
    let h = FastPathOptions::from_env_with(env(&[(ENV_HELPER_SHARE, "50")])).unwrap();
    assert_eq!(h.helper_share, Some(0.5));
    assert!(FastPathOptions::from_env_with(env(&[(ENV_HELPER_SHARE, "150")])).is_err());
    assert_eq!(d.map_reads, MapReads::Off);
    for (v, want) in [
        ("0", MapReads::Off),
        ("huge", MapReads::HugePages),
        ("1", MapReads::HugePages),
        ("tmpfs", MapReads::Tmpfs),
    ] {
        let pairs: &'static [(&'static str, &'static str)] =
            Box::leak(Box::new([(ENV_MAP_READS, v)]));
        let o = FastPathOptions::from_env_with(env(pairs)).unwrap();
        assert_eq!(o.map_reads, want, "{v}");
    }
    let on =
        FastPathOptions::from_env_with(env(&[(ENV_DIRECT, "1"), (ENV_DIRECT_WINDOW_MIB, "512")]))
            .unwrap();
    assert!(on.direct && on.direct_window == 512 << 20);
    let z = FastPathOptions::from_env_with(env(&[(ENV_COMPRESSION, "zstd")])).unwrap();
    assert_eq!(z.image.compression, Compression::Zstd { level: 1 });
    for (var, bad) in [
        (ENV_COMPRESSION, "lz4"),
        (ENV_COMPRESSION, "zstd:99"),
        (ENV_CHUNK_MIB, "0"),
        (ENV_CHUNK_MIB, "2048"),
        (ENV_STREAMS, "x"),
        (ENV_PIN, "yes"),
        (ENV_DIRECT, "on"),
        (ENV_DIRECT_WINDOW_MIB, "0"),
        (ENV_MAP_READS, "yes"),
    ] {
        let pairs: &'static [(&'static str, &'static str)] = Box::leak(Box::new([(var, bad)]));
        let err = FastPathOptions::from_env_with(env(pairs)).unwrap_err();
        assert_eq!(err.var, var);
    }
}

/// The first data file (`*.bin`) of an image, e.g. to damage it.
/// The image's largest data file: one a worker wrote a single short chunk to can be a
/// byte long, and `read_dir`'s order is not fixed.
fn largest_data_file(image: &Path) -> PathBuf {
    std::fs::read_dir(image)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".bin"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("the image has a data file")
}

/// A temporary directory on tmpfs, or `None` (with a message) where there is none.
fn tmpfs_dir() -> Option<tempfile::TempDir> {
    let shm = Path::new("/dev/shm");
    if !gpu_state::image::is_tmpfs(shm) {
        eprintln!("skipped: /dev/shm is not tmpfs");
        return None;
    }
    Some(tempfile::tempdir_in(shm).unwrap())
}

/// Direct copy-out with windows of 3 chunks (so several are registered).
fn direct() -> FastPathOptions {
    FastPathOptions {
        direct: true,
        direct_window: 3 * CHUNK,
        ..pipelined()
    }
}

/// Every chunk record but the data-file places: (offset, len, crc32c, blake3, where),
/// where is "zero", "parent", or "data" with the index of the first chunk of the image
/// stored at the same place (so dedup shows).
type FullRecord = (u64, u64, Option<u32>, Option<String>, String);

fn full_records(dir: &Path) -> Vec<(u64, Vec<FullRecord>)> {
    use gpu_state::image::Location;
    let reader = ImageReader::open(dir).unwrap();
    let mut first = std::collections::HashMap::new();
    let mut n = 0;
    reader
        .allocations()
        .iter()
        .map(|a| {
            let c = a
                .chunks
                .iter()
                .map(|c| {
                    n += 1;
                    let at = match c.at {
                        Location::Zero => "zero".to_string(),
                        Location::Parent { .. } => "parent".to_string(),
                        Location::Data { file, offset, .. } => {
                            format!("data {}", first.entry((file, offset)).or_insert(n))
                        }
                    };
                    (c.offset, c.len, c.crc32c, c.blake3.map(|h| h.to_hex()), at)
                })
                .collect();
            (a.va, c)
        })
        .collect()
}

/// Allocated bytes and sizes of an image's data files.
fn data_usage(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".bin"))
        .map(|p| std::fs::metadata(p).unwrap())
        .fold((0, 0), |(b, l), m| (b + m.blocks() * 512, l + m.len()))
}

/// `populate` plus a copy of its largest allocation (duplicate chunks).
fn populate_with_duplicates(s: &Setup) -> Vec<(u64, Vec<u8>)> {
    let mut expected = populate(s);
    let data = expected[5].1.clone();
    let va = s.allocator.alloc(data.len() as u64).unwrap();
    s.driver.copy_from_host(va, &data).unwrap();
    expected.push((va, data));
    expected
}

fn round_trip(s: &Setup, image: &Path, expected: &[(u64, Vec<u8>)]) {
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    s.fast.copy_in(image).unwrap();
    s.fast.thaw().unwrap();
    check(s, expected);
}

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

/// `populate` with word-multiple sizes only (gh1 hashes whole words) plus one odd one,
/// and an all-zero allocation.
fn populate_hashable(s: &Setup) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, size) in [4096u64, 3 * CHUNK as u64 + 16, 5 * G, 4095]
        .into_iter()
        .enumerate()
    {
        let va = s.allocator.alloc(size).unwrap();
        let data = pattern(i as u64 + 7, size);
        s.driver.copy_from_host(va, &data).unwrap();
        out.push((va, data));
    }
    let va = s.allocator.alloc(2 * CHUNK as u64).unwrap();
    let zeros = vec![0; 2 * CHUNK];
    s.driver.copy_from_host(va, &zeros).unwrap();
    out.push((va, zeros));
    out
}

fn with_device_hash(opts: FastPathOptions) -> Setup {
    let s = setup_with(opts);
    s.driver.set_device_hash(true);
    s
}

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
             fastpath::tests::fake_copyin_helper --test-threads=1 -q >/dev/null\n",
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
