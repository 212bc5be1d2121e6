use super::dma::plan_windows;
use super::*;
use crate::alloc::UnsupportedKind;
use crate::control::{socket_path, ControlClient, ControlServer, Controller};
use crate::driver::DriverCall;
use crate::fake::FakeDriver;
use crate::gate::GateState;
use crate::protocol::{Outcome, Reply, Request};
use gpu_state::image::{Compression, ImageOptions, ImageReader, ImageWriter};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod device_hash;
mod direct;
mod fill;
mod helpers;
mod memory;
mod pipeline;
mod prepare;

pub(super) const G: u64 = 64 << 10;
pub(super) const CHUNK: usize = 4096;

pub(super) struct Setup {
    driver: Arc<FakeDriver>,
    allocator: Arc<Allocator<FakeDriver>>,
    gate: Arc<Gate>,
    fast: FastPath<FakeDriver>,
}

pub(super) fn opts() -> FastPathOptions {
    FastPathOptions {
        image: ImageOptions {
            chunk_size: CHUNK,
            compression: Compression::Zstd { level: 1 },
            threads: 2,
            max_in_flight: 2,
            align: 0,
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

pub(super) fn setup() -> Setup {
    setup_with(opts())
}

pub(super) fn setup_with(opts: FastPathOptions) -> Setup {
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
pub(super) fn pattern(seed: u64, len: u64) -> Vec<u8> {
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

pub(super) fn read(driver: &FakeDriver, va: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0; len as usize];
    driver.copy_to_host(va, &mut out).unwrap();
    out
}

/// Allocations of awkward sizes, filled; returns (va, contents).
pub(super) fn populate(s: &Setup) -> Vec<(u64, Vec<u8>)> {
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

pub(super) fn check(s: &Setup, expected: &[(u64, Vec<u8>)]) {
    check_memory(&s.driver, &s.allocator, expected);
}

pub(super) fn check_memory(
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
pub(super) fn full_image_then_change(
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
pub(super) fn pipelined() -> FastPathOptions {
    FastPathOptions {
        image: ImageOptions {
            chunk_size: CHUNK,
            compression: Compression::None,
            threads: 2,
            max_in_flight: 6,
            align: 0,
        },
        streams: 3,
        copy_in_staging: 5 * CHUNK,
        read_threads: 3,
        ..opts()
    }
}

pub(super) fn chunks_of(expected: &[(u64, Vec<u8>)]) -> usize {
    expected.iter().map(|(_, d)| d.len().div_ceil(CHUNK)).sum()
}

/// The first data file (`*.bin`) of an image, e.g. to damage it.
/// The image's largest data file: one a worker wrote a single short chunk to can be a
/// byte long, and `read_dir`'s order is not fixed.
pub(super) fn largest_data_file(image: &Path) -> PathBuf {
    std::fs::read_dir(image)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".bin"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("the image has a data file")
}

/// A temporary directory on tmpfs, or `None` (with a message) where there is none.
pub(super) fn tmpfs_dir() -> Option<tempfile::TempDir> {
    let shm = Path::new("/dev/shm");
    if !gpu_state::image::is_tmpfs(shm) {
        eprintln!("skipped: /dev/shm is not tmpfs");
        return None;
    }
    Some(tempfile::tempdir_in(shm).unwrap())
}

/// Direct copy-out with windows of 3 chunks (so several are registered).
pub(super) fn direct() -> FastPathOptions {
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

/// Each allocation of the image at `dir` and its [`FullRecord`]s.
pub(super) fn full_records(dir: &Path) -> Vec<(u64, Vec<FullRecord>)> {
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
pub(super) fn data_usage(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".bin"))
        .map(|p| std::fs::metadata(p).unwrap())
        .fold((0, 0), |(b, l), m| (b + m.blocks() * 512, l + m.len()))
}

/// `populate` plus a copy of its largest allocation (duplicate chunks).
pub(super) fn populate_with_duplicates(s: &Setup) -> Vec<(u64, Vec<u8>)> {
    let mut expected = populate(s);
    let data = expected[5].1.clone();
    let va = s.allocator.alloc(data.len() as u64).unwrap();
    s.driver.copy_from_host(va, &data).unwrap();
    expected.push((va, data));
    expected
}

pub(super) fn round_trip(s: &Setup, image: &Path, expected: &[(u64, Vec<u8>)]) {
    s.fast.release(false).unwrap();
    s.fast.remap().unwrap();
    s.fast.copy_in(image).unwrap();
    s.fast.thaw().unwrap();
    check(s, expected);
}

/// `populate` with word-multiple sizes only (gh1 hashes whole words) plus one odd one,
/// and an all-zero allocation.
pub(super) fn populate_hashable(s: &Setup) -> Vec<(u64, Vec<u8>)> {
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

pub(super) fn with_device_hash(opts: FastPathOptions) -> Setup {
    let s = setup_with(opts);
    s.driver.set_device_hash(true);
    s
}
