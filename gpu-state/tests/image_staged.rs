//! GPU state image: the staged API a DMA engine uses (stage/commit on a pinned pool,
//! read_chunks_staged), checked against the plain write/read calls.

mod image_util;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gpu_state::image::{
    AllocId, AllocationTags, Compression, ImageError, ImageOptions, ImageReader, ImageWriter,
    Manifest, StagingPin, StagingPool,
};
use image_util::{alloc, largest_data_file, small_opts, write_image, Rng};

const CHUNK: usize = 64 << 10;

#[derive(Default)]
struct CountPin {
    pins: AtomicUsize,
    unpins: AtomicUsize,
}

impl StagingPin for CountPin {
    fn pin(&self, _: *mut u8, _: usize) -> Result<(), String> {
        self.pins.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn unpin(&self, _: *mut u8, _: usize) {
        self.unpins.fetch_add(1, Ordering::SeqCst);
    }
}

/// Per allocation: (va, [(offset, len, crc32c, blake3 hex)]) — what must not depend on
/// how chunks were written.
/// (offset, len, crc32c, blake3 hex) of one chunk.
type ChunkRecord = (u64, u64, Option<u32>, Option<String>);

fn chunk_list(m: &Manifest) -> Vec<(u64, Vec<ChunkRecord>)> {
    m.allocations
        .iter()
        .map(|a| {
            let chunks = a
                .chunks
                .iter()
                .map(|c| (c.offset, c.len, c.crc32c, c.blake3.map(|h| h.to_hex())))
                .collect();
            (a.va, chunks)
        })
        .collect()
}

fn data() -> Vec<image_util::Alloc> {
    let mut rng = Rng(11);
    let mut with_zeros = rng.bytes(4 * CHUNK + 5);
    with_zeros[CHUNK..2 * CHUNK].fill(0);
    let repeated = [rng.bytes(CHUNK), rng.bytes(CHUNK)].concat().repeat(2);
    vec![
        alloc(0x7f00_0000_0000, with_zeros),
        alloc(0x7f00_1000_0000, repeated),
        alloc(0x7f00_2000_0000, rng.bytes(17)),
    ]
}

#[test]
fn staged_chunks_filled_out_of_order_make_the_same_image() {
    let root = tempfile::tempdir().unwrap();
    let opts = ImageOptions {
        compression: Compression::None,
        ..small_opts()
    };
    let allocs = data();
    let reference = write_image(&root.path().join("ref"), None, opts, &allocs);

    let pin = Arc::new(CountPin::default());
    let dir = root.path().join("staged");
    let mut writer = ImageWriter::create_with_pin(&dir, None, opts, Some(pin.clone())).unwrap();
    let mut held = Vec::new();
    for a in &allocs {
        let id = writer
            .begin_allocation(a.va, a.data.len() as u64, AllocationTags::default())
            .unwrap();
        for (i, bytes) in a.data.chunks(CHUNK).enumerate() {
            let mut staged = writer.stage(id, (i * CHUNK) as u64).unwrap();
            assert_eq!(staged.len(), bytes.len());
            staged.data_mut().copy_from_slice(bytes);
            held.push(staged);
            // Keep up to three staged (like DMAs in flight), commit newest first.
            if held.len() == 3 {
                while let Some(s) = held.pop() {
                    writer.commit(s).unwrap();
                }
            }
        }
    }
    for s in held {
        writer.commit(s).unwrap();
    }
    let stats = writer.stats();
    assert!(stats.staging_pinned);
    assert!(stats.peak_in_flight <= opts.max_in_flight);
    let manifest = writer.finish().unwrap();
    assert_eq!(chunk_list(&manifest), chunk_list(&reference));
    assert_eq!(pin.pins.load(Ordering::SeqCst), 1, "pinned once per image");
    assert_eq!(pin.unpins.load(Ordering::SeqCst), 1, "unpinned when done");
}

#[test]
fn staging_the_same_chunk_twice_commits_once() {
    let root = tempfile::tempdir().unwrap();
    let mut writer = ImageWriter::create(&root.path().join("x"), None, small_opts()).unwrap();
    let id = writer
        .begin_allocation(0x1000, 10, AllocationTags::default())
        .unwrap();
    let a = writer.stage(id, 0).unwrap();
    let b = writer.stage(id, 0).unwrap();
    writer.commit(a).unwrap();
    assert!(matches!(writer.commit(b), Err(ImageError::Usage(_))));
    // A dropped stage leaves the chunk unwritten.
    let id2 = writer
        .begin_allocation(0x2000, 10, AllocationTags::default())
        .unwrap();
    drop(writer.stage(id2, 0).unwrap());
    assert!(matches!(
        writer.finish(),
        Err(ImageError::MissingChunks { .. })
    ));
}

#[test]
fn staged_reads_match_and_keep_to_the_pool() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("img");
    let allocs = data();
    write_image(&dir, None, small_opts(), &allocs);
    let reader = ImageReader::open(&dir).unwrap();
    let work: Vec<(AllocId, usize)> = reader
        .allocations()
        .iter()
        .enumerate()
        .flat_map(|(a, alloc)| (0..alloc.chunks.len()).map(move |i| (AllocId(a), i)))
        .collect();
    let pin = Arc::new(CountPin::default());
    let pool = StagingPool::new(3, CHUNK, Some(pin.clone())).unwrap();
    let mut got: HashMap<usize, Vec<u8>> = HashMap::new();
    let mut held = Vec::new();
    reader
        .read_chunks_staged(&work, &pool, 4, |i, buf, len| -> Result<(), ImageError> {
            got.insert(i, buf[..len].to_vec());
            // The sink may keep up to count - 1 buffers (DMAs in flight).
            held.push(buf);
            if held.len() > 2 {
                held.remove(0);
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(got.len(), work.len());
    for (i, (id, index)) in work.iter().enumerate() {
        let a = &allocs[id.0];
        let start = index * CHUNK;
        let end = (start + CHUNK).min(a.data.len());
        assert_eq!(got[&i], a.data[start..end], "chunk {index} of {:#x}", a.va);
    }
    assert!(pool.peak_in_use() <= 3);
    drop(held);
    assert_eq!(pool.in_use(), 0);
    drop(pool);
    assert_eq!(pin.unpins.load(Ordering::SeqCst), 1);
}

#[test]
fn staged_reads_stop_at_the_first_error() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("img");
    let opts = ImageOptions {
        compression: Compression::None,
        ..small_opts()
    };
    let mut rng = Rng(3);
    write_image(&dir, None, opts, &[alloc(0x1000, rng.bytes(8 * CHUNK))]);
    let reader = ImageReader::open(&dir).unwrap();
    let work: Vec<_> = (0..8).map(|i| (AllocId(0), i)).collect();
    let pool = StagingPool::new(2, CHUNK, None).unwrap();

    // The sink fails.
    let mut calls = 0;
    let err = reader
        .read_chunks_staged(&work, &pool, 3, |_, _, _| {
            calls += 1;
            if calls == 3 {
                return Err(ImageError::Usage("sink".into()));
            }
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, ImageError::Usage(ref m) if m == "sink"));
    assert_eq!(calls, 3, "nothing handed on after an error");
    assert_eq!(pool.in_use(), 0);

    // Buffers too small, and a corrupt chunk.
    let small = StagingPool::new(2, CHUNK / 2, None).unwrap();
    assert!(reader
        .read_chunks_staged(&work, &small, 1, |_, _, _| Ok::<(), ImageError>(()))
        .is_err());
    let file = largest_data_file(&dir);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let reader = ImageReader::open(&dir).unwrap();
    let err = reader
        .read_chunks_staged(&work, &pool, 3, |_, _, _| Ok::<(), ImageError>(()))
        .unwrap_err();
    assert!(matches!(err, ImageError::CorruptChunk { .. }), "{err}");
    assert_eq!(pool.in_use(), 0);
}

/// CPU ceiling of the hook's copy path without a GPU: stage/commit of random chunks
/// (zero check, CRC32C, BLAKE3, append to a data file) and read_chunks_staged back.
/// `cargo test --release -p gpu-state --test image_staged -- --ignored --nocapture`;
/// env `IMAGE_BENCH_GIB` (1), `IMAGE_BENCH_THREADS` (CPUs), `IMAGE_BENCH_CHUNK_MIB`
/// (32), `IMAGE_BENCH_DIR` (/dev/shm, so the disk is not measured),
/// `IMAGE_BENCH_NOCOPY=1` (stamp a counter instead of copying each chunk in).
#[test]
#[ignore]
fn staged_throughput() {
    let var = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let gib = var("IMAGE_BENCH_GIB", 1);
    let threads = var("IMAGE_BENCH_THREADS", cpus);
    let chunk = var("IMAGE_BENCH_CHUNK_MIB", 32) << 20;
    let no_copy = var("IMAGE_BENCH_NOCOPY", 0) == 1;
    let base = std::env::var("IMAGE_BENCH_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let root = tempfile::tempdir_in(base).unwrap();
    let dir = root.path().join("img");
    let opts = ImageOptions {
        chunk_size: chunk,
        compression: Compression::None,
        threads,
        max_in_flight: threads + 4,
        align: 0,
    };
    // Distinct chunks: one random chunk with a counter stamped into each copy.
    let pattern = Rng(5).bytes(chunk);
    let total = (gib << 30) as u64;
    let mut writer = ImageWriter::create(&dir, None, opts).unwrap();
    let id = writer
        .begin_allocation(0x7f00_0000_0000, total, AllocationTags::default())
        .unwrap();
    let start = std::time::Instant::now();
    for (n, offset) in (0..total).step_by(chunk).enumerate() {
        let mut staged = writer.stage(id, offset).unwrap();
        let len = staged.len();
        let data = staged.data_mut();
        // Without the copy only the workers are measured (the hook's producer is DMA).
        if !no_copy {
            data.copy_from_slice(&pattern[..len]);
        }
        data[..8].copy_from_slice(&(n as u64).to_le_bytes());
        writer.commit(staged).unwrap();
    }
    writer.finish().unwrap();
    let out = start.elapsed().as_secs_f64();

    let reader = ImageReader::open(&dir).unwrap();
    let work: Vec<_> = (0..reader.allocations()[0].chunks.len())
        .map(|i| (AllocId(0), i))
        .collect();
    let pool = StagingPool::new(threads + 4, chunk, None).unwrap();
    let start = std::time::Instant::now();
    reader
        .read_chunks_staged(&work, &pool, threads, |_, _, _| Ok::<(), ImageError>(()))
        .unwrap();
    let back = start.elapsed().as_secs_f64();
    let gb = total as f64 / 1e9;
    println!(
        "{gib} GiB, {threads} threads, {} MiB chunks: write {:.2} GB/s (incl. one memcpy per chunk), read {:.2} GB/s",
        chunk >> 20,
        gb / out,
        gb / back
    );
}

/// Every `align`-byte slice of the image's data files, by content.
fn slices(dir: &std::path::Path, m: &Manifest, align: usize) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for f in &m.files {
        let bytes = std::fs::read(dir.join(&f.name)).unwrap();
        assert_eq!(bytes.len() as u64, f.size);
        assert_eq!(
            bytes.len() % align,
            0,
            "{} is {} bytes",
            f.name,
            bytes.len()
        );
        for s in bytes.chunks(align) {
            out.insert(image_util::blake3_hex(s));
        }
    }
    out
}

#[test]
fn aligned_chunks_land_in_the_same_slices_whatever_worker_wrote_them() {
    let root = tempfile::tempdir().unwrap();
    let align = CHUNK;
    let opts = ImageOptions {
        chunk_size: 2 * CHUNK,
        compression: Compression::None,
        threads: 3,
        max_in_flight: 4,
        align: align as u64,
    };
    let mut rng = Rng(21);
    let weights = vec![
        alloc(0x7f00_1000_0000, rng.bytes(7 * CHUNK + 5)),
        alloc(0x7f00_2000_0000, rng.bytes(17)),
        alloc(0x7f00_3000_0000, rng.bytes(5 * CHUNK / 2)),
    ];
    let first = write_image(&root.path().join("1"), None, opts, &weights);
    // One allocation more, first: every later chunk is written at another place.
    let mut second_allocs = vec![alloc(0x7f00_0000_0000, rng.bytes(3 * CHUNK + 1))];
    second_allocs.extend(weights.iter().map(|a| alloc(a.va, a.data.clone())));
    let second = write_image(&root.path().join("2"), None, opts, &second_allocs);
    for m in [&first, &second] {
        for a in &m.allocations {
            for c in &a.chunks {
                if let gpu_state::image::Location::Data { offset, .. } = c.at {
                    assert_eq!(offset % align as u64, 0, "chunk at {offset}");
                }
            }
        }
    }
    let (old, new) = (
        slices(&root.path().join("1"), &first, align),
        slices(&root.path().join("2"), &second, align),
    );
    let missing = old.difference(&new).count();
    assert_eq!(missing, 0, "{missing} of {} slices stored again", old.len());
    let reader = ImageReader::open(&root.path().join("2")).unwrap();
    for a in &second_allocs {
        assert_eq!(image_util::read_back(&reader, a.va, None).unwrap(), a.data);
    }
}
